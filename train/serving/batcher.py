"""Dynamic batching: the rows of concurrent requests share compiled shapes, one model run at a time.

Each text of a request is one row, tokenized and truncated by the export's tokenizer. A row waits in the
queue of its length bucket (the smallest of `lengths` that holds it). Each model run takes the oldest
waiting row and the batch around it that costs least per row: for each length L from the oldest row's
bucket up and each of `batch_sizes`, the oldest rows that fit in L, as many as the size holds, priced by
the time that shape took at warm-up (`warm` compiles every shape, then times it). So a short row is padded
into a longer bucket, and a batch grows, only where that is cheaper per row on this machine. Every run
uses a shape compiled at start. While one batch runs (in a worker thread: XLA releases the GIL), the next
requests queue up, so batches grow with the load by themselves; no request waits for a timer.

The queue is bounded (`max_queue` rows): a request that does not fit is refused at once (QueueFullError, a
503 for the HTTP layer), never dropped later. `dynamic=False` is the baseline without batching: each request
runs alone, in arrival order, in the same shapes. `drain()` returns once every accepted row has run.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import itertools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Run = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]  # (tokens, mask) int32[b, l] -> outputs


class QueueFullError(Exception):
    """The queue has no room for the request's rows."""


class ClosedError(Exception):
    """The batcher is draining: it takes no new request."""


@dataclass
class _Job:
    """One request: its rows, its results (one dict of output rows per text) and its future."""

    rows: list[np.ndarray]
    future: asyncio.Future[list[dict[str, np.ndarray]]]
    results: list[dict[str, np.ndarray] | None] = field(default_factory=list)
    remaining: int = 0


@dataclass(frozen=True)
class _Row:
    seq: int
    job: _Job
    index: int


def powers_of_two(limit: int, start: int = 1) -> list[int]:
    """start, 2*start, ... up to and including `limit` (which is added if it is not a power)."""
    out = []
    size = start
    while size < limit:
        out.append(size)
        size *= 2
    return [*out, limit]


class Batcher:
    def __init__(self, run: Run, *, pad_id: int, lengths: list[int], batch_sizes: list[int], max_queue: int,
                 dynamic: bool = True):
        self.run, self.pad_id, self.dynamic = run, pad_id, dynamic
        self.lengths, self.batch_sizes = sorted(set(lengths)), sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.max_queue = max_queue
        self.queued = 0  # rows waiting or running
        self.batches = 0
        self.rows_run = 0
        self.padded_rows = 0
        self.real_tokens = 0
        self.run_tokens = 0
        self.costs: dict[tuple[int, int], float] = {}  # (batch size, length) -> seconds, timed by `warm`
        self._buckets: dict[int, collections.deque[_Row]] = {n: collections.deque() for n in self.lengths}
        self._jobs: collections.deque[_Job] = collections.deque()  # dynamic=False: whole requests in order
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._worker: asyncio.Task[None] | None = None

    # --- start-up -------------------------------------------------------------------------------

    def shapes(self) -> list[tuple[int, int]]:
        return [(b, n) for n in self.lengths for b in self.batch_sizes]

    def warm(self, say: Callable[[str], None] | None = None, threads: int | None = None,
             stop: threading.Event | None = None) -> float:
        """Compile every shape (on `threads` threads, default one per core), then time each one (the
        better of two runs, one shape at a time): the costs the batches are chosen by. Returns the seconds
        it took. Blocking: call it in a thread. Once `stop` is set (a signal), no shape is begun: it returns
        when the compiles in progress end."""
        started = time.perf_counter()
        shapes = self.shapes()
        done = 0
        halted = stop.is_set if stop is not None else lambda: False

        def one(shape: tuple[int, int]) -> float:
            if halted():
                return 0.0
            tokens = np.full(shape, self.pad_id, np.int32)
            mask = np.zeros(shape, np.int32)
            mask[:, 0] = 1
            begin = time.perf_counter()
            self.run(tokens, mask)
            return time.perf_counter() - begin

        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            for _ in pool.map(one, shapes):
                done += 1
                if say is not None and done % max(1, len(shapes) // 4) == 0 and done < len(shapes) and not halted():
                    say(f"compiled {done}/{len(shapes)} shapes ({time.perf_counter() - started:.0f}s)")
        for shape in shapes:
            if halted():
                break
            self.costs[shape] = min(one(shape), one(shape))
        return time.perf_counter() - started

    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._work(), name="batcher")

    # --- requests -------------------------------------------------------------------------------

    async def submit(self, rows: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
        """The model's outputs for each row (a dict of arrays without the batch axis), in order."""
        if self._closed:
            raise ClosedError
        if self.queued + len(rows) > self.max_queue:
            raise QueueFullError
        job = _Job(rows, asyncio.get_running_loop().create_future(), [None] * len(rows), len(rows))
        self.queued += len(rows)
        if self.dynamic:
            for i, row in enumerate(rows):
                self._buckets[self._bucket(len(row))].append(_Row(next(self._seq), job, i))
        else:
            self._jobs.append(job)
        self._wake.set()
        return await asyncio.shield(job.future)  # a client that leaves does not cancel the rows in the batch

    def _bucket(self, length: int) -> int:
        return self.lengths[min(bisect.bisect_left(self.lengths, max(length, 1)), len(self.lengths) - 1)]

    # --- the worker -----------------------------------------------------------------------------

    def _next_batch(self) -> list[tuple[_Job, int]]:
        if not self.dynamic:
            if not self._jobs:
                return []
            job = self._jobs[0]
            start = len(job.rows) - job.remaining  # a request over max_batch rows runs in several batches
            take = [(job, i) for i in range(start, min(start + self.max_batch, len(job.rows)))]
            if start + len(take) >= len(job.rows):
                self._jobs.popleft()
            return take
        waiting = [n for n in self.lengths if self._buckets[n]]
        if not waiting:
            return []
        oldest = min(waiting, key=lambda n: self._buckets[n][0].seq)  # the oldest row's bucket
        best: tuple[float, int, int] | None = None  # (cost per row, length, rows)
        for length in (n for n in self.lengths if n >= oldest):
            eligible = sum(len(self._buckets[n]) for n in waiting if n <= length)
            for size in self.batch_sizes:  # a smaller batch may cost less per row (a CPU's caches)
                rows = min(size, eligible)
                per_row = self.cost(size, length) / rows
                if best is None or (per_row, -rows) < (best[0], -best[2]):  # a tie: the fuller batch
                    best = (per_row, length, rows)
                if size >= eligible:
                    break
        assert best is not None
        _, length, rows = best
        queues = [self._buckets[n] for n in waiting if n <= length]
        batch: list[tuple[_Job, int]] = []
        while len(batch) < rows:
            row = min((q for q in queues if q), key=lambda q: q[0].seq).popleft()  # oldest first
            batch.append((row.job, row.index))
        return batch

    def _size(self, rows: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, rows)]

    def cost(self, size: int, length: int) -> float:
        """Seconds a run of shape [size, length] took at warm-up (before it: proportional to size * length)."""
        return self.costs.get((size, length), size * length * 1e-6)

    def _pad(self, batch: list[tuple[_Job, int]]) -> tuple[np.ndarray, np.ndarray]:
        rows = [job.rows[i] for job, i in batch]
        length = self._bucket(max(len(r) for r in rows))
        size = self._size(len(rows))
        tokens = np.full((size, length), self.pad_id, np.int32)
        mask = np.zeros((size, length), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = row
            mask[i, :len(row)] = 1
        self.padded_rows += size - len(rows)
        self.real_tokens += int(mask.sum())
        self.run_tokens += mask.size
        return tokens, mask

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._next_batch()
            if not batch:
                if self._closed and self.queued == 0:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            tokens, mask = self._pad(batch)
            try:
                outputs: dict[str, np.ndarray] | BaseException = await loop.run_in_executor(
                    self._executor, self.run, tokens, mask)
            except Exception as err:  # a failed run fails its requests, not the server
                outputs = err
            self.batches += 1
            self.rows_run += len(batch)
            self.queued -= len(batch)
            for k, (job, i) in enumerate(batch):
                if isinstance(outputs, BaseException):
                    if not job.future.done():
                        job.future.set_exception(outputs)
                    continue
                job.results[i] = {name: value[k] for name, value in outputs.items()}
                job.remaining -= 1
                if job.remaining == 0 and not job.future.done():
                    job.future.set_result(list(job.results))  # type: ignore[arg-type]
            self._drop_failed()

    def _drop_failed(self) -> None:
        """Rows still queued for a request that already failed: drop them (their answer was sent)."""
        for n in self.lengths:
            queue = self._buckets[n]
            kept = [r for r in queue if not r.job.future.done()]
            if len(kept) != len(queue):
                self.queued -= len(queue) - len(kept)
                self._buckets[n] = collections.deque(kept)
        while self._jobs and self._jobs[0].future.done():
            self.queued -= self._jobs.popleft().remaining

    # --- shutting down --------------------------------------------------------------------------

    async def drain(self) -> None:
        """Take no new request; return once every accepted row has run."""
        self._closed = True
        self._wake.set()
        if self._worker is not None:
            await self._worker
        self._executor.shutdown(wait=True)

    def stats(self) -> dict[str, Any]:
        return {"batching": "dynamic" if self.dynamic else "off", "queued_rows": self.queued,
                "max_queue_rows": self.max_queue, "batches": self.batches, "rows": self.rows_run,
                "mean_batch_rows": round(self.rows_run / self.batches, 2) if self.batches else 0.0,
                "padded_rows": self.padded_rows,
                "real_token_share": round(self.real_tokens / self.run_tokens, 3) if self.run_tokens else 0.0,
                "lengths": self.lengths, "batch_sizes": self.batch_sizes}
