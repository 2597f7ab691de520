"""Streaming, sharded, resumable batches of packed rows from text corpora too large for memory (Grain).

Shape letters: N rows in this process's batch, L row length, Z logical shards, W processes.

A corpus is one or many files (text, JSONL or ArrayRecord), read lazily in blocks of texts
(train/data/corpus_blocks.py). Blocks are dealt round-robin to Z logical shards, fixed by the config and
independent of W.

Each shard is its own Grain pipeline: its blocks in a seeded global order, reshuffled every epoch and
repeated forever -> tokenized (a block at a time) -> examples shuffled in a window of `window` ->
first-fit packed into rows of L tokens -> N/Z rows per step. Process p of W runs shards
[p*Z/W, (p+1)*Z/W) and concatenates their rows, so it reads only its share, and the global batch
(every process's rows in process order) is the same for any W that divides Z: 1 process x 8 devices
and 2 processes x 4 see the same global rows, and the MLM corruption keyed by global row matches too.

State: `BatchStream.get_state()` is a JSON-able dict: the position of each logical shard this process
reads (Grain's state of that shard's pipeline: block position, shuffle window, packer), the step, and the
stream's identity (config, tokenizer). A position belongs to a shard, not to a process, so the states of
every process of a run (`merge_states`) resume the same global stream on any process count that divides
K, with any prefetch mode: 2 processes -> 1 or 1 -> 2 continue with exactly the rows the uninterrupted
stream would have given, each example once. `set_state` refuses a state of another identity.
`grain.checkpoint.CheckpointSave(stream.orbax_item)` / `CheckpointRestore(stream.orbax_item)` put one
process's state in an Orbax checkpoint (Grain's handler: one JSON file per process).

Batch (dict of NumPy arrays): tokens int32[N, L], valid_tokens bool[N, L] (True = real token, real tokens
first in each row), segment_ids int32[N, L] (0.. per example in row order, -1 on padding); with
masking also mlm_targets int32[N, L] and mlm_weights float32[N, L] (`train.data.masking.mask_batch`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import grain
import numpy as np
from absl import flags as absl_flags
from grain.experimental import (
    FirstFitPackIterDataset,
    FlatMapIterDataset,
    FlatMapTransform,
    WindowShuffleIterDataset,
    ZipIterDataset,
)

from train.data.corpus_blocks import CorpusBlocks, corpus_files
from train.data.datasets import DataError, check_process
from train.data.masking import MaskingSpec, mask_batch
from train.data.stream_positions import merge_states, pipeline_state, upgrade, wrapped_state
from train.data.tokenizer import Tokenizer

__all__ = ["BatchStream", "StreamConfig", "merge_states", "shard_range"]

Batch = dict[str, np.ndarray]
@dataclass(frozen=True)
class StreamConfig:
    """paths: files, directories (every regular file inside, sorted) or glob patterns.
    format: text | jsonl | arrayrecord | auto (by suffix: .jsonl/.json, .arrayrecord/.array_record, else text).
    batch_rows: rows in the GLOBAL batch (all processes); a multiple of num_shards.
    max_segments: at most S examples packed in a row (None: as many as fit).
    window: examples in the shuffle window (bounded memory); seed: shuffles and masking.
    """

    paths: tuple[str, ...]
    row_len: int = 128
    batch_rows: int = 64
    num_shards: int = 8
    max_segments: int | None = 32
    format: str = "auto"
    text_field: str = "text"
    seed: int = 0
    window: int = 4096
    block_bytes: int = 1 << 16
    records_per_block: int = 256


def shard_range(num_shards: int, process_index: int, process_count: int) -> range:
    """The logical shards process p of W reads: a contiguous run of Z/W."""
    check_process(process_index, process_count)
    if num_shards % process_count:
        raise DataError(f"{num_shards} corpus shards do not divide among {process_count} processes: set the "
                        "shard count to a multiple of the process count")
    per = num_shards // process_count
    return range(process_index * per, (process_index + 1) * per)


class _TokenizeBlock(FlatMapTransform):
    """A block of texts -> its non-empty examples {"tokens": int32[<= max_len]}, in order.

    A shard whose every block is empty would make the endless stream spin: after `blocks` empty blocks
    in a row (a whole epoch of the shard) it stops with a DataError.
    """

    max_fan_out = 1 << 20

    def __init__(self, tokenizer: Tokenizer, max_len: int, blocks: int, corpus: str):
        self.tokenizer, self.max_len, self.blocks, self.corpus = tokenizer, max_len, blocks, corpus
        self.empty_in_a_row = 0

    def flat_map(self, element: list[str]) -> list[dict[str, np.ndarray]]:
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        ids = encode_batch(element) if encode_batch else [self.tokenizer.encode(t) for t in element]
        out = [{"tokens": np.asarray(row[:self.max_len], np.int32)} for row in ids if len(row)]
        self.empty_in_a_row = 0 if out else self.empty_in_a_row + 1
        if self.empty_in_a_row >= self.blocks:
            raise DataError(f"the corpus ({self.corpus}) has no text in a whole shard: add text or use fewer "
                            "shards")
        return out


class _Finish:
    """Zipped shard batches -> one process batch in the repo's convention (+ MLM corruption)."""

    def __init__(self, pad_id: int, masking: MaskingSpec | None, seed: int, row_offset: int, first_step: int):
        self.pad_id, self.masking, self.seed = pad_id, masking, seed
        self.row_offset, self.first_step = row_offset, first_step

    def __call__(self, index: int, parts: tuple[dict[str, np.ndarray], ...]) -> Batch:
        segments = np.concatenate([p["tokens_segment_ids"] for p in parts]).astype(np.int32) - 1  # Grain: 1.., 0 pad
        valid = segments >= 0
        tokens = np.where(valid, np.concatenate([p["tokens"] for p in parts]), self.pad_id).astype(np.int32)
        batch = {"tokens": tokens, "valid_tokens": valid, "segment_ids": segments}
        if self.masking is None:
            return batch
        return mask_batch(batch, self.masking, seed=self.seed, step=self.first_step + index,
                          row_offset=self.row_offset)


class BatchStream(Iterator[Batch]):
    """This process's batches, step after step, forever (the corpus repeats, reshuffled each epoch).

    tokenizer: any train/data/tokenizer.py tokenizer (encodes on the fly, in the stream's worker when
    `prefetch` is "process"). masking: corrupt each batch for MLM, keyed by (seed, step, global row).
    prefetch: None (in the calling thread), "thread" or "process" (one background worker process that
    runs the whole pipeline and overlaps it with the training step).
    """

    def __init__(self, config: StreamConfig, tokenizer: Tokenizer, *, process_index: int = 0,
                 process_count: int = 1, masking: MaskingSpec | None = None, prefetch: str | None = None,
                 buffer: int = 4, read_threads: int = 1):
        cfg = config
        if cfg.batch_rows % cfg.num_shards:
            raise DataError(f"batch of {cfg.batch_rows} rows does not divide among {cfg.num_shards} corpus "
                            "shards: make the batch size a multiple of the shard count")
        shards = shard_range(cfg.num_shards, process_index, process_count)
        blocks = CorpusBlocks(corpus_files(cfg.paths), fmt=cfg.format, text_field=cfg.text_field,
                              block_bytes=cfg.block_bytes, records_per_block=cfg.records_per_block)
        if len(blocks) < cfg.num_shards:
            raise DataError(f"the corpus has {len(blocks)} blocks for {cfg.num_shards} shards: lower the block "
                            "size, lower the shard count, or add text")
        self.config, self.process_index, self.process_count = cfg, process_index, process_count
        self.shards = shards
        self.rows = cfg.batch_rows // process_count
        self.read_threads, self.prefetch = read_threads, prefetch
        self.tokenizer_kind, self.tokenizer_vocab = tokenizer.kind, tokenizer.vocab_size
        per_shard = cfg.batch_rows // cfg.num_shards
        pipelines = [self._shard(blocks, s, tokenizer, per_shard) for s in shards]
        finish = _Finish(tokenizer.pad_id, masking, cfg.seed, shards.start * per_shard, 0)
        ds = ZipIterDataset(pipelines).map_with_index(finish)
        if prefetch == "thread":
            ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=buffer)
        elif prefetch == "process":
            if not absl_flags.FLAGS.is_parsed():  # Grain's worker reads absl flags; the trainer uses none
                absl_flags.FLAGS.mark_as_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=1, per_worker_buffer_size=buffer),
                                worker_init_fn=_exit_with_parent)
        elif prefetch is not None:
            raise DataError(f"unknown prefetch '{prefetch}': use none, thread or process")
        # The iterator lives in a holder the finalizer empties, so that no reference outlives the release.
        self._holder: list[Any] = [iter(ds)]
        self._release = weakref.finalize(self, _release_iterator, self._holder)
        self.step = 0

    @property
    def _iterator(self) -> Any:
        if not self._holder:
            raise RuntimeError("the stream was closed: make a new BatchStream (and set_state) to read on")
        return self._holder[0]

    def _shard(self, blocks: CorpusBlocks, shard: int, tokenizer: Tokenizer, rows: int) -> grain.IterDataset:
        cfg = self.config
        seed = (cfg.seed * 1_000_003 + shard) % 2**32
        ds = grain.MapDataset.source(blocks)[shard::cfg.num_shards]
        tokenize = _TokenizeBlock(tokenizer, cfg.row_len, len(ds), ", ".join(map(str, blocks.files)))
        ds = ds.shuffle(seed=seed).repeat(None)
        # Few reader threads and a short read-ahead: blocks are large, the machine may have 2 cores, and
        # Grain's defaults (16 threads, 500 elements per shard) would hold 500 blocks per shard in memory.
        reading = grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=2 * self.read_threads)
        it = FlatMapIterDataset(ds.to_iter_dataset(reading), tokenize)
        it = WindowShuffleIterDataset(it, window_size=cfg.window, seed=seed)
        it = FirstFitPackIterDataset(it, length_struct={"tokens": cfg.row_len}, num_packing_bins=rows,
                                     shuffle_bins=False, max_sequences_per_bin=cfg.max_segments)
        return it.batch(rows, drop_remainder=True)

    def __next__(self) -> Batch:
        batch = next(self._iterator)
        if self.prefetch == "process":
            # The worker hands each array over in a shared-memory segment, unlinked when the array is
            # deleted. A batch still referenced at interpreter exit (the loop's last batch) is deleted after
            # the modules it needs, is never unlinked, and multiprocessing warns "leaked shared_memory":
            # keep private copies and release the segments now.
            batch = {key: np.array(value) for key, value in batch.items()}
        self.step += 1
        return batch

    def identity(self) -> dict[str, Any]:
        """What a saved state is only valid for: the stream's config and the tokenizer (positions count
        tokenized examples). Neither the process layout nor the prefetch mode is part of it: a position
        is kept per logical shard, and any process that reads a shard can continue it."""
        return {"config": {**asdict(self.config), "paths": list(self.config.paths)},
                "tokenizer": [self.tokenizer_kind, self.tokenizer_vocab]}

    def get_state(self) -> dict[str, Any]:
        """JSON-able: this process's position, one entry per logical shard it reads ("shards": {shard:
        Grain state of that shard's pipeline}) plus the step. `set_state` with the states of every process
        (`merge_states`) resumes at the next batch exactly, on any process count that divides the shards."""
        pipeline = pipeline_state(self._iterator.get_state(), self.prefetch)
        parts = pipeline["parent"]["parents"]
        return {"identity": self.identity(), "step": self.step, "layout": [self.process_index, self.process_count],
                "shards": {str(s): part for s, part in zip(self.shards, parts, strict=True)}}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from `state`: one process's `get_state()`, or `merge_states` of every process's. It
        must hold a position for each shard this process reads (any layout that saved them)."""
        state = upgrade(state)
        if state.get("identity") != json.loads(json.dumps(self.identity())):
            raise DataError("the saved input-stream state belongs to a different corpus, batch size, shard count, "
                            "row length, seed or tokenizer: resume with the run's data settings, or start a new "
                            "workdir")
        missing = [s for s in self.shards if str(s) not in state["shards"]]
        if missing:
            raise DataError(f"the saved input-stream state has no position for corpus shards {missing}: pass the "
                            "states of every process that saved the run (merge_states)")
        parents = [state["shards"][str(s)] for s in self.shards]
        pipeline = {"parent": {"parents": parents}, "counter": int(state["step"])}
        self._iterator.set_state(wrapped_state(pipeline, self._iterator, self.prefetch))
        self.step = int(state["step"])

    @property
    def orbax_item(self) -> _OrbaxItem:
        """For `grain.checkpoint.CheckpointSave(...)` / `CheckpointRestore(...)` in an Orbax checkpoint."""
        return _OrbaxItem(self)

    def close(self) -> None:
        """Stop the prefetch thread or worker process and release everything it holds now (idempotent).
        A stream not closed is closed when the interpreter starts to exit (weakref.finalize), before the
        modules its objects need are torn down."""
        self._release()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exit_with_parent(worker_index: int, worker_count: int) -> None:
    """Runs in Grain's worker process as it starts: end it once the process that started it is gone. A
    training process killed with SIGKILL (a preemption, an OOM kill) cannot stop its worker, which would
    otherwise wait forever, holding its memory, as a child of init."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _release_iterator(holder: list[Any]) -> None:
    """Close a Grain iterator and release what it holds, now rather than at interpreter exit: Grain's
    iterators finalized during shutdown print 'Exception ignored' errors, and the shared-memory segments
    of a worker's batches would be reported leaked."""
    if not holder:
        return
    iterator = holder.pop()
    close = getattr(iterator, "close", None)
    if close is not None:
        close()  # the worker stops; the batches it had buffered are unlinked
    del iterator, close
    gc.collect()  # Grain's iterator objects (and any shared-memory array) are finalized here
    _wait_for_shared_memory_release()

def _wait_for_shared_memory_release() -> None:
    """Grain unlinks a released shared-memory segment in a one-thread pool (asynchronously); the pool runs
    its tasks in order, so an empty task returning means every earlier release is done."""
    # upstream: https://github.com/google/grain/issues/398 (shared memory released at shutdown, with errors);
    # a private class of grain 0.2.18, pinned in pyproject.toml; tests/train/checkpoints/test_upstream.py
    # fails if it moves.
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    pool = getattr(SharedMemoryArray, "_del_thread_pool", None)
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.apply(int)


class _OrbaxItem:
    """Grain's Orbax handler saves a non-Grain iterator's state as JSON text encoded in bytes."""

    def __init__(self, stream: BatchStream):
        self.stream = stream

    def get_state(self) -> bytes:
        return json.dumps(self.stream.get_state(), indent=1).encode()

    def set_state(self, state: bytes) -> None:
        self.stream.set_state(json.loads(state))

    def start_prefetch(self) -> None:
        """Called by the handler after a restore; the stream fetches on demand."""
