"""The private upstream internals the trainer still relies on, each pinned in pyproject.toml with the reason
beside its use: these tests fail, naming the file to revisit, when an upgrade changes what they rely on."""

from __future__ import annotations

import inspect
from importlib import metadata


def test_orbax_still_runs_each_sync_call_in_a_fresh_loop_that_it_closes_with_tasks_pending():
    from orbax.checkpoint._src import asyncio_utils

    assert metadata.version("orbax-checkpoint") == "0.12.8", (
        "orbax-checkpoint changed: check train/checkpoints/event_loops.py still wraps the right function, then "
        "update the pin in pyproject.toml and here")
    source = inspect.getsource(asyncio_utils._run_sync_via_new_loop)  # the function event_loops wraps
    assert "new_event_loop()" in source and "loop.close()" in source
    assert "asyncio.all_tasks(" not in source, (
        "Orbax now finishes pending tasks itself: drop train/checkpoints/event_loops.py")


def test_grain_still_releases_shared_memory_in_the_pool_stream_waits_on():
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    assert metadata.version("grain") == "0.2.18", (
        "grain changed: check train/data/stream.py's wait for shared memory still applies, then update the pin in "
        "pyproject.toml and here")
    assert hasattr(SharedMemoryArray, "_del_thread_pool")
