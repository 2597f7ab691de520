"""jaxblock.xla_options: the CPU kind read from /proc/cpuinfo, the user's XLA_FLAGS winning flag by flag,
options unknown to the installed jaxlib dropped (never passed on to abort XLA), too-late and switched-off
calls changing nothing, a measurement of this machine (python -m bench.tune_xla) beating the kind's table,
and (slow) the subprocess probe, the tuner end to end, and `python -m bench` naming the set it used."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxblock import xla_options
from jaxblock.xla_options import Cpu, apply, format_flags, known, parse_flags, read_cpu

ROOT = Path(__file__).resolve().parents[2]
INTEL = ("vendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8581C\n"
         "flags\t\t: fpu sse2 avx2 avx512f amx_bf16\n")
AMD = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B45\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
OLD = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx2\n"
JAXLIB = "0.10.2"  # a version the table lists: no subprocess


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    """Each test reads and writes a cache of its own, never the user's ~/.cache/jaxblock."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _cpu(text: str) -> Cpu:
    return Cpu(**{**read_cpu(text).__dict__, "machine": "x86_64"})


def test_cpu_kind_from_vendor_and_isa():
    assert _cpu(INTEL).kind == "intel-avx512"
    assert _cpu(AMD).kind == "amd-avx512"
    assert _cpu(OLD).kind == "amd-avx2"
    assert _cpu(AMD).model == "AMD EPYC 9B45"
    assert Cpu("", "Apple M2", frozenset(), "arm64").kind == "arm64"


def test_flags_parse_and_format_round_trip():
    parsed = parse_flags("--a=1  --b --c=x,y stray")
    assert parsed == {"a": "1", "b": "", "c": "x,y"}
    assert parse_flags(format_flags(parsed)) == parsed
    assert format_flags({"a": ""}) == "--a="  # XLA aborts on a bare --a for a string option
    assert parse_flags("--a='1 --b") == {"a": "'1", "b": ""}  # an unbalanced quote never raises


def test_both_measured_kinds_keep_xlas_defaults():
    """The Intel Xeon (2026-12-02) and the AMD EPYC measurements both found no option 1.03x faster at both
    shapes: their rows are empty and apply() adds nothing to XLA_FLAGS."""
    for text, kind in ((INTEL, "intel-avx512"), (AMD, "amd-avx512")):
        assert kind in xla_options.OPTIONS and xla_options.OPTIONS[kind] == {}
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        chosen = apply(env, cpu=_cpu(text), jaxlib=JAXLIB)
        assert chosen.applied == {} and chosen.status == "nothing to apply" and chosen.source == f"{kind} table"
        assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


@pytest.fixture
def amd_set(monkeypatch):
    """A two-option set for the AMD kind (its measured set is XLA's defaults: nothing to apply)."""
    options = {xla_options.YNN_FUSION: "dot", "xla_cpu_use_xnnpack": "true"}
    monkeypatch.setitem(xla_options.OPTIONS, "amd-avx512", options)
    return options


@pytest.fixture
def intel_set(monkeypatch):
    """A one-option set for the Intel kind (its measured set is XLA's defaults: nothing to apply)."""
    options = {xla_options.GRAPH_FUSION: xla_options.GREEDY}
    monkeypatch.setitem(xla_options.OPTIONS, "intel-avx512", options)
    return options


def test_applies_the_kinds_set_after_the_users_flags(amd_set, intel_set):
    for text, expected in ((INTEL, intel_set), (AMD, amd_set)):
        env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        chosen = apply(env, cpu=_cpu(text), jaxlib=JAXLIB)
        assert expected and chosen.applied == expected and chosen.status == "applied"
        assert parse_flags(env["XLA_FLAGS"]) == {"xla_force_host_platform_device_count": "2", **expected}
        assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=2 ")
        assert _cpu(text).model in chosen.describe() and format_flags(expected) in chosen.describe()


def test_the_users_own_value_wins_per_flag(amd_set):
    name = xla_options.YNN_FUSION
    env = {"XLA_FLAGS": f"--{name}=users-choice"}
    chosen = apply(env, cpu=_cpu(AMD), jaxlib=JAXLIB)
    assert parse_flags(env["XLA_FLAGS"]) == {name: "users-choice", "xla_cpu_use_xnnpack": "true"}
    assert chosen.user_kept == {name: "users-choice"} and chosen.applied == {"xla_cpu_use_xnnpack": "true"}
    assert "user's XLA_FLAGS kept" in chosen.describe()


def test_an_option_unknown_to_the_installed_jaxlib_is_dropped_not_passed_on(monkeypatch, amd_set):
    monkeypatch.setitem(xla_options.OPTIONS, "amd-avx512", {"xla_cpu_no_such_option": "1", **amd_set})
    env: dict[str, str] = {}
    chosen = apply(env, cpu=_cpu(AMD), jaxlib=JAXLIB)
    assert chosen.dropped == {"xla_cpu_no_such_option": "1"}
    assert "xla_cpu_no_such_option" not in env["XLA_FLAGS"] and chosen.applied == amd_set
    assert known({"xla_cpu_no_such_option": "1"}, JAXLIB) == {"xla_cpu_no_such_option": False}


def test_a_value_outside_the_versions_table_is_unknown():
    assert known({xla_options.YNN_FUSION: "dot,warp_drive"}, JAXLIB) == {xla_options.YNN_FUSION: False}


def test_an_unlisted_jaxlib_is_probed_and_the_answer_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[dict[str, str]] = []

    def starts(options: dict[str, str], timeout_s: float = 0) -> bool:
        calls.append(options)
        return "xla_cpu_no_such_option" not in options

    monkeypatch.setattr(xla_options, "_starts", starts)
    options = {"xla_cpu_no_such_option": "1", "xla_cpu_use_xnnpack": "true"}
    assert known(options, "9.9.9") == {"xla_cpu_no_such_option": False, "xla_cpu_use_xnnpack": True}
    assert len(calls) == 3  # all together (fails), then one by one
    assert known(options, "9.9.9") == {"xla_cpu_no_such_option": False, "xla_cpu_use_xnnpack": True}
    assert len(calls) == 3  # the second answer came from the cache
    cache = json.loads((tmp_path / "jaxblock" / "xla-options-jaxlib-9.9.9.json").read_text())
    assert cache == {"--xla_cpu_no_such_option=1": False, "--xla_cpu_use_xnnpack=true": True}


def test_switched_off_and_unmeasured_kinds_change_nothing(amd_set):
    env = {"XLA_FLAGS": "--a=1", xla_options.ENV_SWITCH: "off"}
    assert apply(env, cpu=_cpu(AMD), jaxlib=JAXLIB).status.startswith("off")
    assert env["XLA_FLAGS"] == "--a=1"
    env = {}
    assert apply(env, cpu=Cpu("", "Apple M2", frozenset(), "arm64"), jaxlib=JAXLIB).status == "nothing to apply"
    assert "XLA_FLAGS" not in env


def test_too_late_once_the_backend_started(monkeypatch):
    import jax

    monkeypatch.setattr(xla_options, "_APPLIED", None)  # restored after the test
    jax.devices()  # the test process's backend is up: XLA has read its flags
    before = os.environ.get("XLA_FLAGS")
    chosen = apply(cpu=_cpu(AMD), jaxlib=JAXLIB)
    assert chosen.status.startswith("too late") and os.environ.get("XLA_FLAGS") == before
    assert xla_options.current() == chosen


@pytest.mark.slow
def test_importing_jaxblock_leaves_the_environment_alone():
    code = "import os, jaxblock, jaxblock.xla_options; print(os.environ.get('XLA_FLAGS', '<unset>'))"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "<unset>"


@pytest.mark.slow
def test_the_probe_finds_what_this_jaxlib_knows(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    answer = xla_options.probe({"xla_cpu_no_such_option": "1", "xla_cpu_enable_xprof_traceme": "true"}, "probe-test")
    assert answer == {"xla_cpu_no_such_option": False, "xla_cpu_enable_xprof_traceme": True}


@pytest.mark.slow
def test_bench_names_the_machine_and_option_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # XDG_CACHE_HOME: this test's own
    command = [sys.executable, "-m", "bench", "--quick", "--only", "peak", "--json", str(tmp_path / "r.json")]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    cpu = read_cpu()
    assert f"machine: {cpu.model} [{cpu.kind}]" in out.stdout
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["cpu"] == cpu.model and meta["xla_options"]["chosen"] == xla_options.choice(cpu)[0]
    assert meta["xla_options"]["status"] in ("applied", "nothing to apply")


# --- a measurement of this machine (python -m bench.tune_xla) ---------------------------------------------


def _measure(cpu: Cpu, options: dict[str, str], jaxlib: str = JAXLIB) -> Path:
    return xla_options.save_measured(cpu, jaxlib, {"options": options, "measured_at": "2026-12-01"})


def test_a_measured_choice_beats_the_kinds_table_for_that_cpu_model_and_jaxlib_only(amd_set):
    ynn_off = {xla_options.YNN_FUSION: ""}
    _measure(_cpu(AMD), ynn_off)
    env: dict[str, str] = {}
    chosen = apply(env, cpu=_cpu(AMD), jaxlib=JAXLIB)
    assert chosen.applied == ynn_off and env["XLA_FLAGS"] == f"--{xla_options.YNN_FUSION}="
    assert "measured on this machine 2026-12-01" in chosen.describe()
    # Another model of the same kind, or another jaxlib, still gets the kind's table.
    other = Cpu(**{**_cpu(AMD).__dict__, "model": "AMD EPYC 7B13"})
    assert apply({}, cpu=other, jaxlib=JAXLIB).applied == amd_set
    assert apply({}, cpu=_cpu(AMD), jaxlib="0.10.3").applied == amd_set
    assert "amd-avx512 table" in apply({}, cpu=other, jaxlib=JAXLIB).describe()


def test_measured_defaults_override_the_table_and_the_users_flags_still_win(intel_set):
    _measure(_cpu(INTEL), {})  # measured: nothing beat XLA's defaults on this Intel model
    chosen = apply({}, cpu=_cpu(INTEL), jaxlib=JAXLIB)
    assert intel_set and chosen.applied == {} and chosen.status == "nothing to apply"
    assert chosen.source.startswith("measured")
    name = xla_options.YNN_FUSION
    _measure(_cpu(INTEL), {name: "", "xla_cpu_no_such_option": "1"})
    env = {"XLA_FLAGS": f"--{name}=dot"}
    chosen = apply(env, cpu=_cpu(INTEL), jaxlib=JAXLIB)
    assert chosen.user_kept == {name: "dot"} and chosen.dropped == {"xla_cpu_no_such_option": "1"}
    assert env["XLA_FLAGS"] == f"--{name}=dot"


def test_a_damaged_measurement_file_falls_back_to_the_table_and_is_kept_aside_on_save(amd_set):
    path = _measure(_cpu(INTEL), {})
    path.write_text("{ not json")
    assert apply({}, cpu=_cpu(AMD), jaxlib=JAXLIB).applied == amd_set  # unreadable: the table, no error
    _measure(_cpu(AMD), {})
    assert path.with_name(path.name + ".unreadable").read_text() == "{ not json"
    assert json.loads(path.read_text()) == {
        xla_options.machine_key(_cpu(AMD), JAXLIB): {"options": {}, "measured_at": "2026-12-01"}}
    # An entry of the wrong shape is ignored, and saving keeps the other machines' entries.
    path.write_text(json.dumps({xla_options.machine_key(_cpu(AMD), JAXLIB): {"options": ["x"]}, "other": {}}))
    assert apply({}, cpu=_cpu(AMD), jaxlib=JAXLIB).applied == amd_set
    _measure(_cpu(INTEL), {})
    assert set(json.loads(path.read_text())) == {"other", xla_options.machine_key(_cpu(AMD), JAXLIB),
                                                 xla_options.machine_key(_cpu(INTEL), JAXLIB)}


def test_the_tuner_keeps_a_candidate_only_if_it_wins_at_every_shape():
    from bench.tune_xla import decide

    speedups = {"a": [1.05, 1.04], "b": [1.30, 1.01], "c": [1.08, 1.06]}
    assert decide(speedups, 1.03) == "c"  # b is faster on average but loses at the second shape
    assert decide(speedups, 1.07) is None
    assert decide({"a": [0.9, 0.95]}, 1.0) is None and decide({}, 1.03) is None


@pytest.mark.parametrize("argv", [["--reps", "0"], ["--margin", "0.9"], ["--margin", "fast"], ["--bogus"]])
def test_the_tuners_usage_errors_are_one_line_and_exit_2(argv, capsys):
    from bench.tune_xla import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m bench.tune_xla: error:") and "Traceback" not in "".join(err)


@pytest.mark.slow
def test_the_tuner_measures_saves_and_apply_uses_it(monkeypatch, tmp_path, capsys):
    import bench.context
    from bench import tune_xla

    monkeypatch.setattr(bench.context, "CPU_SHAPES", bench.context.QUICK_SHAPES)
    assert tune_xla.main(["--reps", "2", "--warmup", "1", "--margin", "1.0"]) == 0
    out = capsys.readouterr().out
    entry = xla_options.measured(read_cpu())
    assert entry is not None and entry["margin"] == 1.0 and len(entry["speedups"]) >= 1
    choice = out.split("choice: ", 1)[1].split(" (", 1)[0]
    assert choice == (format_flags(entry["options"]) or "XLA's defaults")
    assert apply({}, jaxlib=None).chosen == entry["options"]
    # A cache that cannot be written: one line, exit 1, nothing else touched.
    blocker = tmp_path / "blocked"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert tune_xla.main(["--reps", "1", "--warmup", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not save the choice" in err[0]
    assert blocker.read_text() == "a file where the cache directory would go"


def test_an_interrupted_tuner_says_so_in_one_line_and_saves_nothing(monkeypatch, capsys):
    from bench import tune_xla

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_xla, "_tune", interrupted)
    assert tune_xla.main([]) == 130
    assert capsys.readouterr().err.strip() == "python -m bench.tune_xla: interrupted; nothing saved"
    assert not xla_options.measured_path().exists()
