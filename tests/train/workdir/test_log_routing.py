"""train/workdir/log_routing.py: while a run trains, Orbax's (absl) error records go to the workdir's library
log, also those that a save's thread writes after the run itself has already failed."""

import logging
import sys
import threading
import time

import pytest

from train.workdir.log_routing import library_errors_to


class _SaveThread(threading.Thread):
    """Like Orbax's save threads (and taken for one: the routing waits only for Orbax's threads, not for
    thread pools' workers that live until exit): not a daemon, logs its failure through absl, and join()
    re-raises it."""

    def __init__(self, delay_s: float):
        super().__init__(name="serialize_shardings")
        self.delay_s, self.error = delay_s, None

    def run(self) -> None:
        time.sleep(self.delay_s)
        self.error = OSError("No space left on device")
        logging.getLogger("absl").error("save thread raised an exception: %s", self.error)

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def _late_library_error(delay_s: float, monkeypatch: pytest.MonkeyPatch) -> threading.Thread:
    monkeypatch.setattr(_SaveThread, "__module__", "orbax.checkpoint._src.futures.future")
    thread = _SaveThread(delay_s)
    thread.start()
    return thread


def test_a_save_thread_failing_after_the_run_failed_logs_to_the_file_not_the_terminal(tmp_path, capfd, monkeypatch):
    log = tmp_path / "orbax.log"
    pool_worker_done = threading.Event()  # a thread of another library's, living on: not waited for
    other = threading.Thread(target=pool_worker_done.wait, name="ThreadPoolExecutor-0_0")
    start = time.monotonic()
    with pytest.raises(OSError, match="disk full"), library_errors_to(log):
        other.start()
        thread = _late_library_error(0.3, monkeypatch)
        raise OSError("disk full while writing tb")
    assert time.monotonic() - start < 30 and other.is_alive()
    pool_worker_done.set()
    other.join()
    assert not thread.is_alive()  # waited for, its own error from join() swallowed: the run's error is the one
    assert "No space left on device" in log.read_text()
    out, err = capfd.readouterr()
    assert "No space left" not in err and "No space left" not in out
    absl = logging.getLogger("absl")
    assert absl.propagate and not any(str(log) == getattr(h, "baseFilename", None) for h in absl.handlers)
    assert sys.stderr is not None and not hasattr(sys.stderr, "path")


def test_without_a_failure_the_block_does_not_wait_for_threads(tmp_path):
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="still running")
    start = time.monotonic()
    with library_errors_to(tmp_path / "orbax.log"):
        thread.start()
    assert time.monotonic() - start < 5 and thread.is_alive()
    release.set()
    thread.join()
