"""train/aot/isolate.py: `compile` and `lower` run in a child process, so a compiler's native abort is one line,
exit 1, and a flag a native library refuses at start-up is one line, exit 2."""

from __future__ import annotations

import json
import os
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


XLA_REFUSAL = "F1207 08:19:16.755740   24744 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_no_such=1"
LIBTPU_REFUSAL = "ERROR: Unknown command line flag 'xla_tpu_no_such'"


def test_a_refused_flag_is_named_with_its_variable() -> None:
    assert isolate.unknown_flag(f"W1207 a warning\n{XLA_REFUSAL}\n", {}) == (
        "error: XLA_FLAGS holds a flag this jaxlib does not know (--xla_no_such=1): correct or remove it")
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_latency_hiding_scheduler=false --xla_tpu_no_such=1"}
    assert isolate.unknown_flag(LIBTPU_REFUSAL, env) == (
        "error: LIBTPU_INIT_ARGS holds a flag this libtpu does not know (--xla_tpu_no_such): correct or remove it")
    assert isolate.unknown_flag(LIBTPU_REFUSAL, {}).startswith("error: a flag variable holds")  # type: ignore[union-attr]
    assert isolate.unknown_flag("W1207 a warning\n" + CHECK, {}) is None


@pytest.mark.parametrize("json_out", [False, True])
def test_a_child_that_exits_on_a_refused_flag_is_one_line_exit_2(capfd: pytest.CaptureFixture[str],
                                                                 json_out: bool) -> None:
    before = set(Path(isolate.tempfile.gettempdir()).glob("jaxblock-compiler-report-*"))
    code, out, err = _run(f"os.write(2, b'{XLA_REFUSAL}\\n'); os._exit(1)", capfd, json_out=json_out)
    line = "error: XLA_FLAGS holds a flag this jaxlib does not know (--xla_no_such=1): correct or remove it"
    assert code == 2 and err.splitlines() == ["probe 1: fits", line]
    assert (json.loads(out) == {"error": line}) if json_out else out == ""
    assert set(Path(isolate.tempfile.gettempdir()).glob("jaxblock-compiler-report-*")) == before


@pytest.mark.parametrize("command, doing", [("compile", "compiling"), ("lower", "lowering")])
def test_the_ahead_of_time_commands_run_in_a_child(monkeypatch: pytest.MonkeyPatch, command: str, doing: str) -> None:
    """The whole-process CLI hands `compile` and `lower` to isolate.run (with their arguments, --json seen); in
    the child (CHILD_ENV set) the command runs itself."""
    from train import __main__ as cli

    seen: list[tuple[list[str], bool, str]] = []
    monkeypatch.setattr(isolate, "run",
                        lambda command, json_out=False, doing="": seen.append((command, json_out, doing)) or 7)
    monkeypatch.delenv(isolate.CHILD_ENV, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cli._main([command, "--config", "c.yaml", "--json"], True) == 7
    assert seen == [([sys.executable, "-m", "train", command, "--config", "c.yaml", "--json"], True, doing)]


@pytest.mark.slow
def test_a_bad_compile_from_the_shell_is_still_one_line_with_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "train", "compile", "--config", "nowhere.yaml", "--target", "v5e-8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "nowhere.yaml" in proc.stderr and proc.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("command", [["compile", "--target", "v5e-8"], ["lower", "--platform", "tpu"]])
def test_a_mistyped_xla_flag_from_the_shell_is_one_line_with_exit_2(command: list[str]) -> None:
    """XLA exits 1 at start-up on a flag it does not know, having said so on fd 2 only: before the child ran
    both commands, `compile` and `lower` then exited 1 without a word."""
    env = {**os.environ, "XLA_FLAGS": "--xla_no_such_flag=1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "train", command[0], "--config", "configs/tiny.yaml", *command[1:]],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [
        "error: XLA_FLAGS holds a flag this jaxlib does not know (--xla_no_such_flag=1): correct or remove it"]
