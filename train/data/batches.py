"""Batch sources: where the loop takes its batches from, injected into it (train/loop/trainer.py).

A source gives this process's share of each training step's global batch, the batches of a whole
evaluation split, and the state a resumed run needs to continue reading exactly where it stopped. That
state travels in every checkpoint (`state()` is saved, `restore()` receives it on resume); the in-memory
source has none, because its batches are a pure function of (seed, step).

Batch dicts hold host numpy arrays: tokens int32[N, L], valid_tokens bool[N, L] (True = real token, real
tokens first) and the task's targets (train/tasks/base.py); N is this process's rows.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from train.config import Config
from train.data import labelled as data

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
    to the smallest fitting bucket (length-sorted within windows with data.sort_window), or packed when
    data.packing is on; evaluation in order (shortest first with data.sort_window), the last batch topped
    up with empty rows labelled -1."""

    def __init__(self, dataset: data.Dataset, config: Config, share: tuple[int, int] = (0, 1)):
        self.dataset = dataset
        self.seed = config.train.seed
        self.batch_size = config.train.batch_size
        self.buckets = list(config.data.buckets)
        self.pack_segments = config.data.pack_segments if config.data.packing else None
        self.sort_window = config.data.sort_window
        self.process_index, self.process_count = share

    def _train_batch(self, step: int, pack_segments: int | None) -> Batch:
        return data.train_batch(
            self.dataset.train, seed=self.seed, step=step, batch_size=self.batch_size, buckets=self.buckets,
            process_index=self.process_index, process_count=self.process_count, pack_segments=pack_segments,
            sort_window=self.sort_window,
        )

    def batch(self, step: int) -> Batch:
        return self._train_batch(step, self.pack_segments)

    def example_batch(self, step: int) -> Batch:
        return self._train_batch(step, None)

    def eval_batches(self, split: str) -> Iterator[Batch]:
        return data.eval_batches(getattr(self.dataset, split), batch_size=self.batch_size, buckets=self.buckets,
                                 process_index=self.process_index, process_count=self.process_count,
                                 by_length=self.sort_window > 1)

    def state(self) -> dict[str, Any] | None:
        return None

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            raise ValueError(f"the in-memory batch source keeps no reading position, but got {state!r}")


class StreamBatches:
    """Batches streamed from a corpus too large for memory (train/data/stream.py, Grain), masked for MLM.

    Training reads one endless stream in step order: `batch(step)` must be called for steps 0, 1, 2, ...
    (from the restored step on resume). Its reading position (`state()`: every process's position per
    logical shard) travels in every checkpoint, so a resumed run reads, packs and masks exactly the rows
    the uninterrupted one would have, also on another process count. This process reads only its share
    of the logical shards (`share`).
    Evaluation reads the held-out files afresh each time (no prefetch): "validation" is their first
    `data.eval_batches` batches, "test" the next as many; the masking is keyed by a fixed seed, so every
    evaluation scores the same positions.
    """

    def __init__(self, corpus: Any, config: Config, share: tuple[int, int] = (0, 1)):
        from train.data.corpus_blocks import corpus_files
        from train.data.stream import BatchStream, StreamConfig

        d, self.corpus = config.data, corpus
        self.process_index, self.process_count = share
        self.eval_batches_per_split = d.eval_batches

        def stream_config(paths: list[str], seed: int, fmt: str) -> StreamConfig:
            # Blocks of at most 64 KiB, smaller for a small corpus: every shard needs several blocks to shuffle.
            size = sum(f.stat().st_size for f in corpus_files(paths))
            block = int(np.clip(size // (8 * d.stream_shards), 2048, 1 << 16))
            return StreamConfig(paths=tuple(paths), row_len=d.max_len, batch_rows=config.train.batch_size,
                                num_shards=d.stream_shards, max_segments=d.pack_segments, format=fmt,
                                text_field=d.text_column, seed=seed, window=d.shuffle_window, block_bytes=block,
                                records_per_block=64)

        fmt = d.format if d.source == "corpus" else "text"
        self._make_eval = lambda: BatchStream(stream_config(corpus.heldout_paths, 1_000_003, fmt), corpus.tokenizer,
                                              process_index=self.process_index, process_count=self.process_count,
                                              masking=corpus.masking)
        self.stream = BatchStream(stream_config(corpus.train_paths, config.train.seed, fmt), corpus.tokenizer,
                                  process_index=self.process_index, process_count=self.process_count,
                                  masking=corpus.masking, prefetch=None if d.prefetch == "none" else d.prefetch)
        self.last: Batch | None = None
        # The loop does not close its source; a worker process must still be stopped before shutdown.
        atexit.register(self.close)

    def batch(self, step: int) -> Batch:
        if step != self.stream.step:
            raise RuntimeError(f"the stream is at step {self.stream.step} but step {step} was asked for: a "
                               "streamed source is read in step order (restore its state to resume)")
        self.last = next(self.stream)
        return self.last

    def example_batch(self, step: int) -> Batch:
        if self.last is None or step != self.stream.step - 1:
            raise RuntimeError(f"a streamed source keeps only its last batch (step {self.stream.step - 1}), not {step}")
        return self.last

    def eval_batches(self, split: str) -> Iterator[Batch]:
        if split not in ("validation", "test"):
            raise ValueError(f"a streamed corpus has held-out 'validation' and 'test' batches, not '{split}'")
        stream = self._make_eval()
        skip = self.eval_batches_per_split if split == "test" else 0
        try:
            for i in range(skip + self.eval_batches_per_split):
                batch = next(stream)
                if i >= skip:
                    yield batch
        finally:
            stream.close()

    def unigram_accuracy(self) -> float:
        """Masked-token accuracy on the validation batches of always predicting the most frequent token
        of the training text's first `data.eval_batches` batches (this process's share)."""
        counts = np.zeros(self.corpus.tokenizer.vocab_size + 1, np.int64)
        from train.data.stream import BatchStream

        train = BatchStream(self.stream.config, self.corpus.tokenizer,
                            process_index=self.process_index, process_count=self.process_count, masking=None)
        try:
            for _ in range(self.eval_batches_per_split):
                b = next(train)
                counts += np.bincount(b["tokens"][b["valid_tokens"]], minlength=counts.size)
        finally:
            train.close()
        counts[: self.corpus.masking.first_regular_id] = 0
        top = int(np.argmax(counts))
        hits = total = 0.0
        for b in self.eval_batches("validation"):
            chosen = b["mlm_weights"] > 0
            hits += float(np.sum(b["mlm_targets"][chosen] == top))
            total += float(np.sum(chosen))
        return hits / max(total, 1.0)

    def state(self) -> dict[str, Any] | None:
        """Every process's stream position, gathered (the checkpoint's meta is written by process 0 only);
        every process must call it, as the loop does at each save."""
        return {"processes": _allgather_json(self.stream.get_state())}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue from the positions every process saved. They are kept per logical corpus shard, so the
        run resumes on any process count that divides the shard count (2 -> 1, 1 -> 2, ...): each process
        takes the positions of the shards it now reads, and the global batches go on as before."""
        from train.data.datasets import DataError
        from train.data.stream import merge_states

        saved = (state or {}).get("processes")
        if not saved:
            raise DataError("the checkpoint holds no input-stream position (data_state): it was not written by a "
                            "streamed run; resume with the run's own config or start a new workdir")
        self.stream.set_state(merge_states(saved))

    def close(self) -> None:
        self.stream.close()


def _allgather_json(value: Any) -> list[Any]:
    """[value of process 0, value of process 1, ...]: JSON-able values gathered from every process."""
    import json

    import jax

    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [json.loads(everyone[i, :n].tobytes()) for i, n in enumerate(sizes)]
