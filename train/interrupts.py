"""What Ctrl-C (SIGINT) and SIGTERM do, at every moment of a command: one line, a consistent workdir.

The policy, which the CLI installs around a whole command with `Interrupts`:
- Outside the training loop (start-up, data, compile, evaluation, predict): the first signal stops the
  command; `run_interruptible` prints one line ("interrupted during compile: ...") and returns exit code
  130 (128 + SIGINT, what a shell reports for Ctrl-C; SIGTERM also gives 130, one code for "interrupted").
- Inside `graceful()` (the training loop): the first signal only sets `stop_requested`; the loop finishes
  the current step, saves synchronously, writes curves and summary and returns (exit 0). A second signal
  means "stop now": it raises `Interrupted` at once, unless a checkpoint save is being finished.
- Inside `critical(...)` (waiting for a checkpoint save to commit, writing summary files): signals are
  held until the section ends, so Orbax's wait is never interrupted. An interrupted
  `CheckpointManager.wait_until_finished` is what logs "Save Finalize thread failed" with two tracebacks
  (orbax/checkpoint/checkpoint_manager.py, `wait_until_finished`'s `except BaseException`). A signal in a
  critical section prints one line saying the save is being finished; a third signal there leaves at once
  (exit 130): Orbax writes each step into `<step>.orbax-checkpoint-tmp-*` and renames it only when
  complete, so an abandoned save is never listed as a checkpoint (`cleanup_tmp_directories` removes it
  on the next run) and the last complete checkpoint stays the newest.
- The main thread only sees a signal between Python bytecodes, so a long XLA compile or a blocking C call
  would hold a Ctrl-C until it returns. A watcher thread on `signal.set_wakeup_fd` sees every signal
  at once: a second signal while the main thread has not yet reacted to the first, outside a critical
  section, prints the one line and exits 130 immediately (nothing is being written then).

With several processes, SIGTERM is left to JAX's preemption sync (the loop's `reached_preemption`), so that
every process stops at the same step; pass `install=False` there.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any, TextIO

INTERRUPTED_EXIT = 130
_STOP_WATCHING = b"\0"  # never a signal number, which the wakeup fd writes as one byte per signal
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Stop now. A KeyboardInterrupt, so code that already cleans up for Ctrl-C does so here too."""


class Interrupts:
    """Signal policy for one command (main thread only). Use as a context manager around the command."""

    def __init__(self, *, install: bool = True, stream: TextIO | None = None):
        self.install = install and threading.current_thread() is threading.main_thread()
        self.stream = stream if stream is not None else sys.stderr
        self.phase = "start-up"
        self.signals = 0  # received and acted on by the main thread
        self.stop_requested = False
        self._graceful = 0
        self._critical: list[str] = []
        self._held = False
        self._previous: dict[int, Any] = {}
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._watcher: threading.Thread | None = None
        self._previous_wakeup = -1
        self._seen = 0  # counted by the watcher thread as they arrive
        self._redelivered = 0  # signals sent again by the handler (see _handle)

    # --- phases and sections -----------------------------------------------------------------------

    def set_phase(self, phase: str) -> None:
        """Name what the command is doing, for the one line ("interrupted during compile")."""
        self.phase = phase

    @contextlib.contextmanager
    def graceful(self) -> Iterator[Interrupts]:
        """The first signal only requests a stop (poll `stop_requested`); a second stops now."""
        self._graceful += 1
        try:
            yield self
        finally:
            self._graceful -= 1

    @contextlib.contextmanager
    def critical(self, what: str) -> Iterator[None]:
        """Hold signals until `what` (e.g. "finishing checkpoint 40") is done; a held stop-now is raised
        when the section ends."""
        self._critical.append(what)
        try:
            yield
        finally:
            self._critical.pop()
        if self._held and not self._critical:
            self._held = False
            raise Interrupted(f"after {what}")

    def wait_for_saves(self, wait: Callable[[], None], what: str = "the checkpoint save in progress") -> None:
        """Run `wait` (e.g. `Checkpoints.wait`) with signals held, so Orbax's wait is never interrupted."""
        with self.critical(f"finishing {what}"):
            wait()

    # --- the handler -------------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(line + "\n")
            self.stream.flush()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self._critical and self._graceful and not self.stop_requested:
            # The first signal in the training loop only asks for a stop, also while a save is committing.
            self.stop_requested = True
            self._say(f"{name}: stopping after this step and saving a checkpoint (again to stop now)")
            return
        if self._critical:
            if self.signals >= 3:
                self._say(f"{name} again: leaving now; the save in progress is abandoned (never used), the "
                          "previous checkpoint stays the newest")
                _exit_now()
            if not self._held:
                self._say(f"{name}: {self._critical[-1]} first, then stopping (again to abandon it)")
            self._held = True
            self.stop_requested = True
            return
        if self._graceful and not self.stop_requested:
            self.stop_requested = True
            self._say(f"{name}: stopping after this step and saving a checkpoint (again to stop now)")
            return
        if frame is not None and any(getattr(cb, "__code__", None) is frame.f_code for cb in gc.callbacks):
            # Inside a garbage-collector callback (JAX has one) an exception is printed as "Exception
            # ignored" and lost: deliver the signal again a moment later, outside it.
            self.signals -= 1
            self._redelivered += 1
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return
        raise Interrupted(name)

    def _watch(self, fd: int) -> None:
        """Runs in a daemon thread: reads the wakeup fd (one byte per signal) even while the main thread is
        inside a long C call, and leaves at once on a second signal the main thread has not handled."""
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data or _STOP_WATCHING in data:  # __exit__ asks the watcher to end before closing the pipe
                return
            self._seen += len(data)
            # Two signals the main thread has not run its handler for: it is stuck in a C call (a compile).
            if self._seen - self._redelivered - self.signals >= 2 and not self._critical and not self._graceful:
                self._say(f"interrupted during {self.phase}: nothing was being written; the workdir is as it was")
                _exit_now()

    def __enter__(self) -> Interrupts:
        if not self.install:
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, args=(self._wake_r,), daemon=True,
                                         name="interrupt-watcher")
        self._watcher.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.install:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        # End the watcher before closing its pipe: a thread blocked in read() on a closed descriptor would
        # read whatever pipe reuses that number next (a later Interrupts') and act on its signals.
        with contextlib.suppress(OSError, TypeError):
            os.write(self._wake_w, _STOP_WATCHING)  # type: ignore[arg-type]
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        for fd in (self._wake_w, self._wake_r):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = None


def _exit_now() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(INTERRUPTED_EXIT)


RESUMABLE = "checkpoints already saved in the workdir are intact (rerun the same command to continue)"


def run_interruptible(command: Callable[[Interrupts], int], *, install: bool = True,
                      stream: TextIO | None = None, after: str | None = RESUMABLE) -> int:
    """Run `command(interrupts)` under the policy; an interrupt becomes one line and exit code 130. `after`
    ends the line (None for a command with no workdir, such as `compile`)."""
    interrupts = Interrupts(install=install, stream=stream)
    try:
        with interrupts:
            return command(interrupts)
    except KeyboardInterrupt:
        interrupts._say(f"interrupted during {interrupts.phase}: stopped" + (f"; {after}" if after else ""))
        return INTERRUPTED_EXIT
