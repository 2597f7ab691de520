"""Where library noise goes while a run trains: Orbax's (absl) error records and what library threads print
(a failed save's tracebacks, TensorStore's "Event loop is closed") are appended to `<workdir>/orbax.log`,
so the terminal shows only the run's own lines and a fault is reported once, in one line, by the loop.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
from typing import Any

LIBRARY_LOG = "orbax.log"  # Orbax's (absl) error logs, e.g. each save thread's traceback on a full disk
THREAD_WAIT_S = 60.0  # after a failure, how long the library's own save threads get to end and log


class _QuietFileHandler(logging.FileHandler):
    """A log file that never prints 'Logging error' tracebacks (it may be on the disk that is full)."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        pass


class _NoiseFile(io.TextIOBase):
    """A write-only text stream appending to a file, that never fails (it may be on the full disk)."""

    def __init__(self, path: Any):
        self.path = path

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8", errors="replace") as f:
            f.write(text)
        return len(text)


@contextlib.contextmanager
def stderr_to(path: Any) -> Any:
    """File descriptor 2 (what threads and C code print) appended to `path` for the block, if it opens."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


@contextlib.contextmanager
def library_errors_to(path: Any) -> Any:
    """Send absl's log records (Orbax's) to `path` instead of stderr for the block: the loop reports a
    failed save in one line itself."""
    logger = logging.getLogger("absl")
    handler = _QuietFileHandler(path, delay=True)
    handler.setLevel(logging.WARNING)
    previous, previous_stderr = logger.propagate, sys.stderr
    logger.addHandler(handler)
    logger.propagate = False
    # What library threads print through sys.stderr (TensorStore's "Event loop is closed" after a failed
    # save) goes to the same file; the run's own lines keep the terminal's stream (Progress, Interrupts).
    sys.stderr = _NoiseFile(path)
    before = set(threading.enumerate())
    try:
        yield
    except BaseException:
        # A failed run may leave a save's threads still running (the disk filled while a checkpoint was being
        # written and the run then stopped on another write): each logs its own traceback when it fails, which
        # must land in the file, not on the terminal after the run's one line. The interpreter waits for those
        # (non-daemon) threads at exit anyway, so waiting for them here first costs nothing more.
        _join_new_threads(before, THREAD_WAIT_S)
        raise
    finally:
        sys.stderr = previous_stderr
        logger.propagate = previous
        logger.removeHandler(handler)
        with contextlib.suppress(OSError):  # the disk may be full: the run's own error is the one to report
            handler.close()


def _orbax_thread(thread: threading.Thread) -> bool:
    """A thread of Orbax's own (its save threads' class, or a plain thread running an Orbax function such as
    the `async_save` commit): not the thread pools' workers, which live until the interpreter exits."""
    target = getattr(thread, "_target", None)  # CPython's Thread keeps the target function here
    return any(getattr(x, "__module__", "").startswith("orbax") for x in (type(thread), target))


def _join_new_threads(before: set[threading.Thread], timeout_s: float) -> None:
    """Wait, at most timeout_s in all, for Orbax's threads started since `before` was taken."""
    deadline = time.monotonic() + timeout_s
    for thread in set(threading.enumerate()) - before:
        if thread is threading.current_thread() or not _orbax_thread(thread):
            continue
        with contextlib.suppress(Exception):  # Orbax's save threads re-raise their own error from join()
            thread.join(max(0.0, deadline - time.monotonic()))
