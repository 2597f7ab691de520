"""jaxblock.xla_options: the CPU kind read from /proc/cpuinfo, the user's XLA_FLAGS winning flag by flag,
options unknown to the installed jaxlib dropped (never passed on to abort XLA), too-late and switched-off
calls changing nothing, and (slow) the subprocess probe and `python -m bench` naming the set it used."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxblock import xla_options
from jaxblock.xla_options import Cpu, apply, format_flags, known, parse_flags, read_cpu

ROOT = Path(__file__).resolve().parent.parent
INTEL = ("vendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8581C\n"
         "flags\t\t: fpu sse2 avx2 avx512f amx_bf16\n")
AMD = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B45\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
OLD = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx2\n"
JAXLIB = "0.10.2"  # a version the table lists: no subprocess


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
    assert parse_flags("--a='1 --b") == {"a": "'1", "b": ""}  # an unbalanced quote never raises


@pytest.fixture
def amd_set(monkeypatch):
    """A two-option set for the AMD kind (its measured set is XLA's defaults: nothing to apply)."""
    options = {xla_options.YNN_FUSION: "dot", "xla_cpu_use_xnnpack": "true"}
    monkeypatch.setitem(xla_options.OPTIONS, "amd-avx512", options)
    return options


def test_applies_the_kinds_set_after_the_users_flags(amd_set):
    for text, expected in ((INTEL, xla_options.OPTIONS["intel-avx512"]), (AMD, amd_set)):
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
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-m", "bench", "--quick", "--only", "peak", "--json", str(tmp_path / "r.json")]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    cpu = read_cpu()
    assert f"machine: {cpu.model} [{cpu.kind}]" in out.stdout
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["cpu"] == cpu.model and meta["xla_options"]["chosen"] == xla_options.OPTIONS.get(cpu.kind, {})
    assert meta["xla_options"]["status"] in ("applied", "nothing to apply")
