"""The signal policy: one line and exit 130 outside the loop, a graceful stop inside it, saves never cut."""

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train.interrupts import INTERRUPTED_EXIT, Interrupted, Interrupts, run_interruptible

ROOT = Path(__file__).resolve().parents[2]


def _signal_self(sig=signal.SIGINT) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs at the next bytecode of the main thread


def test_outside_the_loop_a_signal_is_one_line_and_exit_130():
    out = io.StringIO()
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite itself runs in the background

    def command(interrupts: Interrupts) -> int:
        interrupts.set_phase("compile")
        _signal_self()
        pytest.fail("the signal did not stop the command")

    assert run_interruptible(command, stream=out) == INTERRUPTED_EXIT
    (line,) = out.getvalue().splitlines()
    assert line.startswith("interrupted during compile: stopped; checkpoints already saved")
    assert signal.getsignal(signal.SIGINT) is before  # restored
    out = io.StringIO()  # a command with no workdir (`compile`, `lower`) speaks of none
    assert run_interruptible(command, stream=out, after=None) == INTERRUPTED_EXIT
    assert out.getvalue() == "interrupted during compile: stopped\n"


def test_in_the_loop_the_first_signal_requests_a_stop_and_the_second_stops_now():
    out = io.StringIO()
    with Interrupts(stream=out) as interrupts, interrupts.graceful():
        _signal_self(signal.SIGTERM)
        assert interrupts.stop_requested
        with pytest.raises(Interrupted):
            _signal_self()
    assert out.getvalue().splitlines() == [
        "SIGTERM: stopping after this step and saving a checkpoint (again to stop now)"]


def test_a_save_being_finished_is_never_interrupted():
    out = io.StringIO()
    finished = []

    def wait() -> None:  # stands for Checkpoints.wait: two signals arrive while it blocks
        _signal_self()
        _signal_self()
        finished.append(True)

    with Interrupts(stream=out) as interrupts, interrupts.graceful():
        interrupts.stop_requested = True  # the first signal already came
        with pytest.raises(Interrupted):
            interrupts.wait_for_saves(wait, "checkpoint 40")
    assert finished == [True]
    assert out.getvalue().splitlines() == [
        "SIGINT: finishing checkpoint 40 first, then stopping (again to abandon it)"]


STUCK = """
import signal, sys, time
from train.interrupts import run_interruptible

def command(interrupts):
    interrupts.set_phase("compile")
    # Signals go to other threads while the main thread sleeps, as while it is inside a long XLA compile:
    # its Python handler cannot run until the call returns.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    print("ready", flush=True)
    time.sleep(60)
    return 0

sys.exit(run_interruptible(command))
"""


@pytest.mark.slow
def test_two_signals_during_a_long_c_call_leave_at_once_with_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == INTERRUPTED_EXIT and time.monotonic() - start < 10
    assert err.splitlines() == ["interrupted during compile: nothing was being written; the workdir is as it was"]


def test_a_finished_command_leaves_no_watcher_thread_behind():
    """A watcher left blocked on a closed wakeup pipe would read the next command's pipe (same descriptor
    number) and exit the process on its signals."""
    import threading

    for _ in range(3):
        assert run_interruptible(lambda interrupts: 0, stream=io.StringIO()) == 0
    assert not [t for t in threading.enumerate() if t.name == "interrupt-watcher"]
