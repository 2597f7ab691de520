"""python -m bench.cpu_report: the record names the machine and versions and holds every command's output with
its status; a failing command is recorded and the exit code says so; bad usage is one line, exit 2; and
(slow) the whole report runs end to end in its quick mode."""

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cpu_report

ROOT = Path(__file__).resolve().parents[2]
CPU = {"Model name": "Intel(R) Xeon(R) Processor", "CPU(s)": "2", "Thread(s) per core": "1",
       "Vendor ID": "GenuineIntel", "CPU family": "6", "Model": "207",
       "Flags": "fpu sse2 avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile"}


def _outcome(argv: list[str], output: str, code: int | None) -> cpu_report.Outcome:
    return cpu_report.Outcome("what it measures", argv, output, code, 12.0, (0.5, 0.4, 0.3), (1.5, 0.6, 0.4))


def test_the_record_names_machine_versions_and_each_commands_output():
    outcomes = [_outcome(["-m", "bench", "--only", "peak"], "peak float32: 232 GFLOP/s\n", 0),
                _outcome(["-m", "bench.ab", "--quick"], "Traceback ...\nboom\n", 1),
                _outcome(["-m", "bench.profile", "--bert"], "half a line", None)]
    text = cpu_report.render(CPU, {"jax": "0.10.2", "torch": "2.13.0"}, "abc1234", "XLA defaults", outcomes,
                             datetime.date(2026, 12, 2), quick=False, malloc="malloc: glibc's defaults")
    assert text.startswith("# Intel(R) Xeon(R) Processor, 2 CPUs, measured 2026-12-02 on abc1234\n")
    assert ('Machine: `lscpu` "Intel(R) Xeon(R) Processor" (vendor GenuineIntel, family 6, model 207); 2 CPUs'
            in text)
    assert "flags include avx2, fma, avx512f, avx512_bf16, amx_bf16, amx_tile." in text
    assert "jax 0.10.2, torch 2.13.0" in text and "XLA_FLAGS: XLA defaults." in text
    assert "Malloc: glibc's defaults." in text
    for o in outcomes:
        assert f"## python {' '.join(o.argv)}\n" in text and o.output.strip() in text
    assert "exit 0;" in text and "**exit 1**" in text and "timed out" in text
    assert text.count("```") == 2 * len(outcomes)
    assert "load average 0.50 before, 1.50 after" in text


def test_the_default_record_is_named_after_the_cpu_and_the_day(tmp_path):
    assert cpu_report.default_out("AMD EPYC", datetime.date(2026, 12, 2)).parent == ROOT / "bench" / "records"
    path = cpu_report.default_out("Intel(R) Xeon(R) Processor", datetime.date(2026, 12, 2), tmp_path)
    assert path == tmp_path / "intel-xeon-processor-2026-12-02.md"
    assert cpu_report.default_out("AMD EPYC", datetime.date(2026, 12, 2), tmp_path).name == "amd-epyc-2026-12-02.md"


def test_a_second_record_on_the_same_day_never_replaces_the_first(tmp_path, capsys):
    day = datetime.date(2026, 12, 2)
    (tmp_path / "amd-epyc-2026-12-02.md").write_text("first")
    assert cpu_report.default_out("AMD EPYC", day, tmp_path).name == "amd-epyc-2026-12-02-2.md"
    (tmp_path / "amd-epyc-2026-12-02-2.md").write_text("second")
    assert cpu_report.default_out("AMD EPYC", day, tmp_path).name == "amd-epyc-2026-12-02-3.md"
    assert cpu_report.main(["--out", str(tmp_path / "amd-epyc-2026-12-02.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--out" in err[0]
    assert (tmp_path / "amd-epyc-2026-12-02.md").read_text() == "first"


def test_a_failed_command_is_recorded_and_the_exit_code_is_1(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_report, "commands", lambda quick: [
        ("fine", ["-c", "print('ok')"]), ("broken", ["-c", "import sys; print('bad'); sys.exit(3)"])])
    out = tmp_path / "r.md"
    assert cpu_report.main(["--out", str(out)]) == 1
    text = out.read_text()
    assert "## python -c print('ok')" in text and "\nok\n" in text and "**exit 3**" in text and "\nbad\n" in text


@pytest.mark.parametrize("argv", [["--bogus"], ["--out"]])
def test_bad_usage_is_one_line_and_exit_2(argv, capsys):
    assert cpu_report.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m bench.cpu_report: error:") and "Traceback" not in "".join(err)


def test_an_unwritable_record_is_one_line_and_exit_2(tmp_path, capsys):
    assert cpu_report.main(["--out", str(tmp_path)]) == 2  # a directory
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory" in err[0]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cpu_report.main(["--out", str(blocker / "r.md")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and blocker.read_text() == "x"


@pytest.mark.slow
def test_the_quick_report_runs_every_command(tmp_path):
    out = tmp_path / "record.md"
    done = subprocess.run([sys.executable, "-m", "bench.cpu_report", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for _, argv in cpu_report.commands(quick=True):
        assert f"## python {' '.join(argv)}\n" in text
    assert text.count("exit 0;") == len(cpu_report.commands(quick=True))
    assert "machine: " in text and "choice: " in text and "heaviest matmul ops" in text
    assert "(--quick: tiny shapes)" in text.splitlines()[0]
