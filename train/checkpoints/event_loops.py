"""Orbax's event loops, closed in order: nothing of a failed read or write outlives its loop.

Orbax runs each synchronous call (a restore, a metadata read, a save's commit in its thread) in a fresh
asyncio event loop (`orbax.checkpoint._src.asyncio_utils._run_sync_via_new_loop`): run the coroutine to
completion, then close the loop. When the coroutine fails, e.g. one TensorStore read of a truncated
array file, `asyncio.gather` raises at the first error while the other reads of the same restore are
still tasks of that loop, and the loop is closed with them pending (six for a two-layer model). Each
holds a TensorStore future; when a read completes later, in TensorStore's thread, its callback meets a
closed loop ("RuntimeError: Event loop is closed" from asyncio/base_events.py), and a task collected
while pending is logged as "Task was destroyed but it is pending". When that happens is a matter of
timing: on a slow machine it is at interpreter exit, after the command's last line.

`install()` wraps that function so that, when the coroutine fails, the loop's remaining tasks are run
until they have finished (cancelling a task is not enough: TensorStore still completes the read and
calls back into the loop), those still pending after a bound are cancelled and run until they have
ended (what `asyncio.run` does on the way out, for this one loop, without touching other threads'
loops), and async generators are shut down, before the loop closes.
A successful call leaves no task behind and is unchanged. The wrapper is installed once, when the
checkpoint store is imported; `pending_tasks()` is what the tests check.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Coroutine
from typing import Any

# upstream: a private function of orbax-checkpoint 0.12.8 (pinned in pyproject.toml), which no public API
# replaces: https://github.com/google/orbax/blob/main/checkpoint/orbax/checkpoint/_src/asyncio_utils.py
# (no Orbax issue reports the leak; tests/train/checkpoints/test_upstream.py fails if the function changes).
from orbax.checkpoint._src import asyncio_utils

_ORIGINAL = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
DRAIN_S = 60.0  # at most this long for the reads of a failed call to finish (they take milliseconds)


def _run_and_close_in_order(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            _finish_pending(loop)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _finish_pending(loop: asyncio.AbstractEventLoop) -> None:
    """Let the loop's unfinished tasks end before it closes: first run them to completion (a read already
    in flight in TensorStore completes within moments, and its callback then finds the loop open); what is
    still pending after `DRAIN_S` is cancelled and run until it has ended. Their errors are the failed
    call's, already raised once: retrieved here, so that none is logged as "never retrieved"."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if pending:
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_S))
    for _ in range(3):  # a cancelled task may start one more (Orbax's cleanup); a few rounds at most
        rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not rest:
            break
        for task in rest:
            task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        pending += rest
    for task in pending:
        if task.done() and not task.cancelled():
            task.exception()
    with contextlib.suppress(BaseException):
        loop.run_until_complete(loop.shutdown_asyncgens())


def install() -> None:
    """Wrap Orbax's fresh-loop runner (once). A later Orbax without it keeps its own behaviour."""
    if _ORIGINAL is not None:
        asyncio_utils._run_sync_via_new_loop = _run_and_close_in_order  # type: ignore[attr-defined]


def installed() -> bool:
    return getattr(asyncio_utils, "_run_sync_via_new_loop", None) is _run_and_close_in_order


def pending_tasks() -> list[asyncio.Task[Any]]:
    """Every asyncio task in this process that has not finished (the tests' measure of a leak)."""
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done()]
