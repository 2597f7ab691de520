"""WorkdirLock: one writer per workdir, refused in one line naming the holder, released by any exit."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.workdir.lock import LOCK_FILE, WorkdirBusyError, WorkdirLock, describe_holder

HOLDER = """
import sys, time
from train.workdir.lock import WorkdirLock
lock = WorkdirLock(sys.argv[1], command="train --workdir w").acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_second_lock_is_refused_naming_the_holder_then_granted_after_release(tmp_path):
    with WorkdirLock(tmp_path, command="train --workdir w") as first:
        assert first.held
        with pytest.raises(WorkdirBusyError) as refused:
            WorkdirLock(tmp_path).acquire()
        message = str(refused.value)
        assert "\n" not in message
        assert f"in use by process {os.getpid()} (train --workdir w)" in message
        assert f"kill {os.getpid()}" in message and "another --workdir" in message
    assert not first.held
    assert describe_holder(tmp_path)["pid"] == os.getpid()  # the description stays, the lock does not
    with WorkdirLock(tmp_path) as again:
        assert again.held
    assert (tmp_path / LOCK_FILE).is_file()  # never deleted: a waiter could otherwise lock a stale inode


def test_a_lock_released_by_an_exception_can_be_taken_again(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), WorkdirLock(tmp_path):
        raise RuntimeError("boom")
    WorkdirLock(tmp_path).acquire().release()


def test_non_primary_processes_take_no_lock(tmp_path):
    with WorkdirLock(tmp_path), WorkdirLock(tmp_path, primary=False) as other:
        assert not other.held


def test_missing_workdir_is_created(tmp_path):
    with WorkdirLock(tmp_path / "new" / "run"):
        assert (tmp_path / "new" / "run" / LOCK_FILE).is_file()


def _start_holder(workdir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_a_lock_held_by_another_process_is_refused_and_released_by_kill_9(tmp_path):
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(WorkdirBusyError, match=rf"in use by process {holder.pid} \(train --workdir w\)"):
            WorkdirLock(tmp_path).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert holder.returncode == -signal.SIGKILL
        start = time.monotonic()
        with WorkdirLock(tmp_path) as lock:  # the kernel dropped the lock with the process: no stale lock
            assert lock.held and time.monotonic() - start < 5
            assert describe_holder(tmp_path)["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()
