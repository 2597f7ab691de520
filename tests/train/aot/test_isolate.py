"""train/aot/isolate.py: `compile` runs in a child process, so a compiler's native abort is one line, exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from train.aot import isolate

# A child as `compile` runs: child_setup first, a Python progress line, then native code's report on fd 2.
CHILD = ("import os, sys; from train.aot import isolate; isolate.child_setup(); "
         "print('probe 1: fits', file=sys.stderr, flush=True); "
         "os.write(2, b'W1206 noise.cc:1] a native warning\\n'); {end}")
CHECK = ("F1206 20:00:00.000 1 memory_bound_loop_optimizer.cc:198] Check failed: "
         "begin_idx_in_loop <= end_idx_in_loop")


def _run(end: str, capfd: pytest.CaptureFixture[str], **kw: bool) -> tuple[int, str, str]:
    code = isolate.run([sys.executable, "-c", CHILD.format(end=end)], **kw)
    out, err = capfd.readouterr()
    return code, out, err


def test_a_native_abort_is_one_line_naming_the_check_and_the_report_exit_1(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(f"os.write(2, b'{CHECK}\\n*** Check failure stack trace: ***\\n    @ 0x7f frame\\n'); "
                          "os.abort()", capfd)
    lines = err.strip().splitlines()
    assert code == 1 and out == ""
    assert lines[0] == "probe 1: fits" and len(lines) == 2  # Python's progress, then the one line
    assert lines[1].startswith("error: the compiler crashed (SIGABRT) compiling: " + CHECK)
    report = Path(lines[1].rsplit(" ", 1)[1])
    try:
        assert "@ 0x7f frame" in report.read_text() and "a native warning" in report.read_text()
    finally:
        report.unlink()


def test_with_json_the_crash_is_an_object_on_stdout_too(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run("os.kill(os.getpid(), 11)", capfd, json_out=True)
    report = json.loads(out)
    assert code == 1 and report["crashed"] == "SIGSEGV" and report["error"] in err
    Path(report["report"]).unlink()


def test_a_killed_child_is_one_line_naming_the_out_of_memory_killer(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run("os.kill(os.getpid(), 9)", capfd)
    assert out == ""
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 2 and "killed (SIGKILL)" in lines[1] and "out-of-memory killer" in lines[1]
    Path(lines[1].rsplit(" ", 1)[1]).unlink()


def test_a_child_that_exits_gives_its_code_and_native_lines_and_leaves_no_file(capfd: pytest.CaptureFixture[str],
                                                                               tmp_path: Path) -> None:
    before = set(Path(isolate.tempfile.gettempdir()).glob("jaxblock-compiler-report-*"))
    code, out, err = _run("print('table'); sys.exit(1)", capfd)
    assert code == 1 and out == "table\n"
    assert err.splitlines() == ["probe 1: fits", "W1206 noise.cc:1] a native warning"]
    assert set(Path(isolate.tempfile.gettempdir()).glob("jaxblock-compiler-report-*")) == before


def test_the_compile_command_runs_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-process CLI hands `compile` to isolate.run (with its arguments, --json seen); in the child
    (CHILD_ENV set) it compiles itself."""
    from train import __main__ as cli

    seen: list[tuple[list[str], bool]] = []
    monkeypatch.setattr(isolate, "run", lambda command, json_out=False: seen.append((command, json_out)) or 7)
    monkeypatch.delenv(isolate.CHILD_ENV, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cli._main(["compile", "--config", "c.yaml", "--target", "v5e-8", "--json"], True) == 7
    assert seen == [([sys.executable, "-m", "train", "compile", "--config", "c.yaml", "--target", "v5e-8", "--json"],
                     True)]


@pytest.mark.slow
def test_a_bad_compile_from_the_shell_is_still_one_line_with_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "train", "compile", "--config", "nowhere.yaml", "--target", "v5e-8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "nowhere.yaml" in proc.stderr and proc.stdout == ""
