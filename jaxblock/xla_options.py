"""XLA CPU compiler options chosen for this machine, applied on request, before JAX starts its backend.

    from jaxblock import xla_options
    chosen = xla_options.apply()      # before the first jax.devices() / jit call; returns what it did
    print(chosen.describe())          # e.g. "Intel(R) Xeon(R) ... [intel-avx512]: --xla_cpu_...=... (applied)"

Importing jaxblock changes nothing: only `apply()` touches `XLA_FLAGS`. `python -m train` and `python -m bench`
call it at start; `JAXBLOCK_XLA_OPTIONS=off` turns it off for them. The rules:

- The options come from a measurement of this very machine when there is one: `python -m bench.tune_xla` times
  the candidates against XLA's defaults on the training step and keeps the winner (or the defaults) in
  ~/.cache/jaxblock/xla-options-measured.json, per CPU model and jaxlib version. Otherwise from `OPTIONS`, one
  set per CPU kind (vendor and vector ISA from /proc/cpuinfo), each measured on that kind of machine
  (docs/performance-cpu.md); a kind without a measurement keeps XLA's defaults. None of them changes
  numerics: float32 dots stay float32, no fast-math option is ever set.
- A user's own `XLA_FLAGS` win, flag by flag: an option the user set (to any value) is left as the user set it.
- XLA aborts the process on an option its build does not know, so every option is checked against the
  installed jaxlib first: from `KNOWN` for the versions it lists, otherwise by starting XLA in a subprocess
  with the options (once per jaxlib version and option; the answer is cached under ~/.cache/jaxblock).
  An unknown option is dropped and reported, never passed on.
- Too late is harmless: once JAX's backend has started, XLA has read its flags, so `apply()` changes nothing
  and says so.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ENV_SWITCH = "JAXBLOCK_XLA_OPTIONS"  # "off" (or "0", "none") disables apply()
GRAPH_FUSION = "xla_cpu_experimental_xnn_graph_fusion_mode"
GREEDY = "XNN_GRAPH_FUSION_MODE_GREEDY"
YNN_FUSION = "xla_cpu_experimental_ynn_fusion_type"  # which HLO ops XNNPACK's YNN kernels take (default: dots)
_YNN_LISTS = frozenset({"", "dot", "dot,eltwise", "dot,reduce", "dot,eltwise,reduce", "+eltwise", "+reduce",
                        "+eltwise,+reduce"})

# CPU kind -> XLA options, from measurements (docs/performance-cpu.md). Both measured kinds keep XLA's defaults:
# - Intel AVX-512 (Xeon, Emerald Rapids, 2 cores, jaxlib 0.10.2; measured 2026-12-02 on a quiet machine, Pre-LN
#   training step, speedup over XLA's defaults at N16 L128 D256 / N8 L256 D512): greedy XNNPACK graph fusion
#   1.010x / 0.935x (python -m bench.tune_xla; 1.02x in the options section); YNN off 0.935x / 0.966x; YNN on
#   dots, elementwise ops and reductions 0.895x / 0.892x; oneDNN (use_onednn, its custom call, its DOT and
#   DOT,ELTWISE fusions) 0.857-1.068x / 0.953-0.995x; XNNPACK off 1.057x / 1.015x. None was 1.03x faster at
#   both shapes. (The greedy row it replaces came from one earlier noisy run.) A second Intel Xeon record
#   (bench/records/intel-xeon-processor-2026-12-02.md, `python -m bench.cpu_report`) kept the defaults again:
#   greedy 0.990x / 1.174x, YNN off 0.886x / 1.043x, YNN on dots, elementwise ops and reductions 0.801x / 0.855x.
# - AMD AVX-512 (EPYC, jaxlib 0.10.2): no option beat XLA's defaults; YNN fusion of elementwise ops and
#   reductions was 5-15% slower and the graph-fusion mode compiled to the very same program.
# Kinds without a measurement keep XLA's defaults too. `python -m bench.tune_xla` measures the candidates on
# the machine itself and keeps a winner for it, which beats this table (bench/options.py XLA_CANDIDATES).
OPTIONS: dict[str, dict[str, str]] = {
    "intel-avx512": {},  # measured: XLA's defaults
    "amd-avx512": {},  # measured: XLA's defaults
}

# jaxlib version prefix -> {option: allowed values (empty: any value)} known to that build (read from its
# flag table). Versions not listed are probed in a subprocess instead.
KNOWN: dict[str, dict[str, frozenset[str]]] = {
    "0.10.": {
        GRAPH_FUSION: frozenset({"XNN_GRAPH_FUSION_MODE_DISABLED", GREEDY, "XNN_GRAPH_FUSION_MODE_GREEDY_SLINKY"}),
        YNN_FUSION: _YNN_LISTS,
        "xla_cpu_experimental_xnn_fusion_type": frozenset(),
        "xla_cpu_use_xnnpack": frozenset({"true", "false"}),
        "xla_cpu_use_onednn": frozenset({"true", "false"}),
        "xla_cpu_prefer_vector_width": frozenset(),
        "xla_cpu_enable_xprof_traceme": frozenset({"true", "false"}),
        "xla_backend_optimization_level": frozenset(),
        "xla_cpu_use_fusion_emitters": frozenset({"true", "false"}),
        "xla_force_host_platform_device_count": frozenset(),
    },
}


@dataclass(frozen=True)
class Cpu:
    """What decides the option set: vendor, model name and the ISA flags the kernel reports."""

    vendor: str
    model: str
    flags: frozenset[str]
    machine: str

    @property
    def kind(self) -> str:
        if self.machine.lower() in ("arm64", "aarch64"):
            return "arm64"
        isa = "avx512" if "avx512f" in self.flags else "avx2" if "avx2" in self.flags else "x86"
        vendor = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}.get(self.vendor, "x86")
        return f"{vendor}-{isa}"


def read_cpu(cpuinfo: str | None = None) -> Cpu:
    """This machine's CPU from /proc/cpuinfo (or the given text); platform's names elsewhere."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    return Cpu(fields.get("vendor_id", ""), model, frozenset(fields.get("flags", "").split()), platform.machine())


def parse_flags(text: str) -> dict[str, str]:
    """'--a=1 --b' -> {'a': '1', 'b': ''} (later wins, as in XLA); tokens that are not flags are ignored."""
    out: dict[str, str] = {}
    try:
        tokens = shlex.split(text or "")
    except ValueError:  # an unbalanced quote: XLA itself splits on whitespace
        tokens = (text or "").split()
    for token in tokens:
        if token.startswith("--"):
            name, _, value = token[2:].partition("=")
            out[name] = value
    return out


def format_flags(options: dict[str, str]) -> str:
    """{'a': '1', 'b': ''} -> '--a=1 --b=': always with '=', since XLA reads a bare '--b' as a boolean switch
    and aborts on it for a string option (an empty YNN fusion list turns YNN off)."""
    return " ".join(f"--{k}={v}" for k, v in options.items())


@dataclass(frozen=True)
class XlaOptions:
    """What `apply()` decided. chosen: this machine's set (source: measured here, or the CPU kind's table);
    applied: what it added to XLA_FLAGS; user_kept: the user's own values that overrode ours; dropped: options
    the installed jaxlib does not know."""

    cpu: str
    kind: str
    status: str  # applied | nothing to apply | off | too late | not applied
    chosen: dict[str, str] = field(default_factory=dict)
    source: str = ""  # where `chosen` came from: this machine's measurement, the CPU kind's table, or neither
    applied: dict[str, str] = field(default_factory=dict)
    user_kept: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    xla_flags: str = ""

    def describe(self) -> str:
        """One line for tables and logs: CPU, kind, the options in effect and why."""
        parts = [format_flags(self.applied) or "XLA defaults"]
        if self.user_kept:
            parts.append(f"user's XLA_FLAGS kept: {format_flags(self.user_kept)}")
        if self.dropped:
            parts.append(f"unknown to this jaxlib, dropped: {format_flags(self.dropped)}")
        status = f"{self.status}; {self.source}" if self.source else self.status
        return f"{self.cpu} [{self.kind}]: {'; '.join(parts)} ({status})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_APPLIED: XlaOptions | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxblock"


def _cache_path(jaxlib: str) -> Path:
    return _cache_dir() / f"xla-options-jaxlib-{jaxlib}.json"


def measured_path() -> Path:
    """Where `python -m bench.tune_xla` keeps its choices: one entry per CPU model and jaxlib version."""
    return _cache_dir() / "xla-options-measured.json"


def machine_key(cpu: Cpu, jaxlib: str) -> str:
    return f"{cpu.model} [{cpu.kind}] jaxlib {jaxlib}"


def jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _read_measured(path: Path) -> dict[str, Any]:
    """The measured-choices file as a dict; {} when absent. Raises ValueError when it is not ours to read."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is unreadable ({type(err).__name__})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def measured(cpu: Cpu, jaxlib: str | None = None) -> dict[str, Any] | None:
    """This machine's entry from `python -m bench.tune_xla` ({"options": {...}, "measured_at": ..., ...}),
    or None: none saved for this CPU model and jaxlib, or the file or entry is damaged (then the table applies)."""
    try:
        entry = _read_measured(measured_path()).get(machine_key(cpu, jaxlib or jaxlib_version()))
    except ValueError:
        return None
    options = entry.get("options") if isinstance(entry, dict) else None
    if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        return None
    return entry


def save_measured(cpu: Cpu, jaxlib: str | None, entry: dict[str, Any]) -> Path:
    """Keep `entry` (with its "options") as this machine's choice, beside other machines' entries. Written to a
    temporary file and renamed, so a crash leaves the old file whole; an unreadable old file is kept aside
    as <name>.unreadable rather than overwritten. Raises OSError when the cache cannot be written."""
    path = measured_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = _read_measured(path)
    except ValueError:
        os.replace(path, path.with_name(path.name + ".unreadable"))
        data = {}
    data[machine_key(cpu, jaxlib or jaxlib_version())] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def choice(cpu: Cpu, jaxlib: str | None = None) -> tuple[dict[str, str], str]:
    """(options, where they came from): this machine's measurement if saved, else the CPU kind's table."""
    entry = measured(cpu, jaxlib)
    if entry is not None:
        return dict(entry["options"]), f"measured on this machine {entry.get('measured_at', '')}".rstrip()
    if cpu.kind in OPTIONS:
        return dict(OPTIONS[cpu.kind]), f"{cpu.kind} table"
    return {}, "no measurement for this CPU kind: python -m bench.tune_xla makes one"


def _starts(options: dict[str, str], timeout_s: float = 120.0) -> bool:
    """Whether XLA's CPU backend starts with these options (a subprocess: an unknown flag aborts it)."""
    env = {**os.environ, "XLA_FLAGS": format_flags(options), "JAX_PLATFORMS": "cpu", ENV_SWITCH: "off"}
    try:
        done = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], env=env,
                              capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def probe(options: dict[str, str], jaxlib: str) -> dict[str, bool]:
    """{option: known to this jaxlib with this value}, from the cache or a subprocess; cached per version."""
    path = _cache_path(jaxlib)
    try:
        cache: dict[str, bool] = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    keys = {k: format_flags({k: v}) for k, v in options.items()}
    missing = {k: options[k] for k, key in keys.items() if key not in cache}
    if missing:
        if _starts(missing):  # the common case: one subprocess for all of them
            cache.update({keys[k]: True for k in missing})
        else:
            cache.update({keys[k]: _starts({k: v}) for k, v in missing.items()})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
        except OSError:
            pass  # an unwritable cache only means probing again next time
    return {k: bool(cache.get(key)) for k, key in keys.items()}


def known(options: dict[str, str], jaxlib: str | None = None) -> dict[str, bool]:
    """{option: the installed jaxlib accepts it (name and value)}: by `KNOWN` where it lists the version."""
    if jaxlib is None:
        jaxlib = jaxlib_version()
    for prefix, table in KNOWN.items():
        if jaxlib.startswith(prefix):
            return {k: k in table and (not table[k] or v in table[k]) for k, v in options.items()}
    return probe(options, jaxlib) if options else {}


def _backend_started() -> bool:
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def apply(env: Any = None, *, cpu: Cpu | None = None, jaxlib: str | None = None) -> XlaOptions:
    """Add this CPU kind's options to `env` (default os.environ) XLA_FLAGS, the user's own flags winning.
    Call before JAX starts its backend; afterwards (or with JAXBLOCK_XLA_OPTIONS=off) it changes nothing."""
    global _APPLIED
    env = os.environ if env is None else env
    cpu = cpu or read_cpu()
    chosen, source = choice(cpu, jaxlib)
    user = parse_flags(env.get("XLA_FLAGS", ""))
    result = XlaOptions(cpu.model, cpu.kind, "nothing to apply", chosen=chosen, source=source,
                        xla_flags=env.get("XLA_FLAGS", ""))
    if env.get(ENV_SWITCH, "").strip().lower() in ("off", "0", "none", "false"):
        result = replace(result, status=f"off ({ENV_SWITCH})")
    elif env is os.environ and _backend_started():
        result = replace(result, status="too late: JAX's backend had started")
    else:
        user_kept = {k: user[k] for k in chosen if k in user}
        wanted = {k: v for k, v in chosen.items() if k not in user}
        ok = known(wanted, jaxlib)
        applied = {k: v for k, v in wanted.items() if ok.get(k)}
        if applied:
            env["XLA_FLAGS"] = " ".join(x for x in (env.get("XLA_FLAGS", "").strip(), format_flags(applied)) if x)
        result = replace(result, status="applied" if applied else "nothing to apply", applied=applied,
                         user_kept=user_kept, dropped={k: v for k, v in wanted.items() if not ok.get(k)},
                         xla_flags=env.get("XLA_FLAGS", ""))
    if env is os.environ:
        _APPLIED = result
    return result


def current() -> XlaOptions:
    """What `apply()` did in this process, or (if it was not called) this machine's kind and XLA_FLAGS as is."""
    if _APPLIED is not None:
        return _APPLIED
    cpu = read_cpu()
    chosen, source = choice(cpu)
    return XlaOptions(cpu.model, cpu.kind, "not applied", chosen=chosen, source=source,
                      user_kept=parse_flags(os.environ.get("XLA_FLAGS", "")),
                      xla_flags=os.environ.get("XLA_FLAGS", ""))
