"""Batch sources: where the loop takes its batches from, injected into it (train/loop.py).

A source gives this process's share of each training step's global batch, the batches of a whole
evaluation split, and the state a resumed run needs to continue reading exactly where it stopped. That
state travels in every checkpoint (`state()` is saved, `restore()` receives it on resume); the in-memory
source has none, because its batches are a pure function of (seed, step).

Batch dicts hold host numpy arrays: tokens int32[N, L], valid_tokens bool[N, L] (True = real token, real
tokens first) and the task's targets (train/tasks.py); N is this process's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from train import data
from train.config import Config

Batch = dict[str, np.ndarray]


class BatchSource(Protocol):
    """What the loop and the evaluation read batches from."""

    def batch(self, step: int) -> Batch:
        """This process's share of the global training batch of `step` (0-based)."""
        ...

    def example_batch(self, step: int) -> Batch:
        """The examples of `step` as a plain padded batch (no packing), for the per-example diagnostics
        and the non-finite locator; a streaming source may give the last batch it returned."""
        ...

    def eval_batches(self, split: str) -> Iterator[Batch]:
        """This process's share of every batch of `split` ("train", "validation", "test"), once, in order."""
        ...

    def state(self) -> dict[str, Any] | None:
        """JSON-serialisable reading position to save with a checkpoint; None when the step is enough."""
        ...

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from a position `state()` returned (called once, before the first `batch`)."""
        ...


class InMemoryBatches:
    """Batches of a loaded `data.Dataset`: training batch t is a pure function of (train.seed, t), padded
    to the smallest fitting bucket, or packed when data.packing is on; evaluation in order, the last batch
    topped up with empty rows labelled -1."""

    def __init__(self, dataset: data.Dataset, config: Config, share: tuple[int, int] = (0, 1)):
        self.dataset = dataset
        self.seed = config.train.seed
        self.batch_size = config.train.batch_size
        self.buckets = list(config.data.buckets)
        self.pack_segments = config.data.pack_segments if config.data.packing else None
        self.process_index, self.process_count = share

    def _train_batch(self, step: int, pack_segments: int | None) -> Batch:
        return data.train_batch(
            self.dataset.train, seed=self.seed, step=step, batch_size=self.batch_size, buckets=self.buckets,
            process_index=self.process_index, process_count=self.process_count, pack_segments=pack_segments,
        )

    def batch(self, step: int) -> Batch:
        return self._train_batch(step, self.pack_segments)

    def example_batch(self, step: int) -> Batch:
        return self._train_batch(step, None)

    def eval_batches(self, split: str) -> Iterator[Batch]:
        return data.eval_batches(getattr(self.dataset, split), batch_size=self.batch_size, buckets=self.buckets,
                                 process_index=self.process_index, process_count=self.process_count)

    def state(self) -> dict[str, Any] | None:
        return None

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            raise ValueError(f"the in-memory batch source keeps no reading position, but got {state!r}")
