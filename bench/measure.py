"""Timing, memory sampling, result records and the printed table.

Every measurement becomes one `Record`: what ran (`config`), its wall-clock seconds per call (median,
min, max over `reps` timed calls after warm-up) and derived `metrics` (tokens/s, FLOP/s, ratios,
memory). Competing variants are timed interleaved (A, B, A, B, ...), so a burst of load from other
processes lands on all of them alike and the ratio of medians stays meaningful on a busy machine.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Record:
    """One measurement. Times are seconds per call; `metrics` holds the derived figures."""

    section: str
    name: str
    config: dict[str, Any]
    median: float
    min: float
    max: float
    reps: int
    unit: str = "s"
    metrics: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_times(
        cls, section: str, name: str, config: dict[str, Any], times: list[float], **metrics: Any
    ) -> Record:
        # The 1-minute load average: on a shared machine it says how contended each measurement was.
        load = {"load_1min": round(os.getloadavg()[0], 2)} if hasattr(os, "getloadavg") else {}
        return cls(section, name, config, statistics.median(times), min(times), max(times), len(times),
                   metrics={**metrics, **load})


def time_interleaved(
    fns: dict[str, Callable[[], Any]], *, reps: int, warmup: int, pause_s: float = 0.02
) -> dict[str, list[float]]:
    """Seconds per call of each function, round-robin. Each function must block until its work is done.

    With several functions, each timed call starts after a `pause_s` sleep: OpenMP (PyTorch) and
    XLA's pool keep their threads spinning for a moment after a call, which would otherwise tax
    whichever library runs next.
    """
    pause = pause_s if len(fns) > 1 else 0.0
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            time.sleep(pause)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def rss_bytes() -> int:
    """This process's resident memory now (psutil; falls back to /proc on Linux)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_rss(interval_s: float = 0.002) -> Iterator[dict[str, int]]:
    """Samples resident memory in a thread while the block runs; yields {'start', 'peak'} (bytes).

    ru_maxrss would only ever grow over the whole run; sampling gives the peak of this block alone.
    """
    out = {"start": rss_bytes(), "peak": 0}
    done = threading.Event()

    def sample() -> None:
        peak = out["start"]
        while not done.is_set():
            peak = max(peak, rss_bytes())
            done.wait(interval_s)
        out["peak"] = max(peak, rss_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        done.set()
        thread.join()


def compiled_memory(compiled: Any) -> dict[str, int]:
    """XLA's static memory plan of a compiled step: arguments + outputs + temporaries - aliased (donated)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    arg = int(stats.argument_size_in_bytes)
    out = int(stats.output_size_in_bytes)
    temp = int(stats.temp_size_in_bytes)
    alias = int(stats.alias_size_in_bytes)
    return {"xla_peak_bytes": arg + out + temp - alias, "xla_temp_bytes": temp, "xla_argument_bytes": arg}


# --- output -------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.3g}" if abs(value) < 10 else f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def _seconds(value: float) -> str:
    return f"{value * 1e3:,.1f} ms" if value < 10 else f"{value:,.1f} s"


_SHOWN = ("tokens_per_s", "ratio", "speedup", "ratio_vs_first", "gflop_per_s", "fraction_of_peak", "mfu",
          "xla_peak_bytes", "rss_peak_bytes", "impl", "note")


def format_table(records: list[Record], machine: str = "") -> str:
    """A plain-text table: one row per record, the headline metrics only (the JSON has everything), under a
    line naming the machine (CPU model and XLA options) when given, so a figure can be traced to it."""
    rows: list[tuple[str, ...]] = [("section", "name", "median", "min", "max", *_SHOWN)]
    for r in records:
        cells = []
        for key in _SHOWN:
            v = r.metrics.get(key, "")
            if key.endswith("_bytes") and isinstance(v, int):
                v = f"{v / 2**20:,.0f} MiB"
            cells.append(_fmt(v))
        rows.append((r.section, r.name, _seconds(r.median), _seconds(r.min), _seconds(r.max), *cells))
    keep = [i for i in range(len(rows[0])) if i < 5 or any(row[i] for row in rows[1:])]
    widths = [max(len(row[i]) for row in rows) for i in keep]
    lines = ["  ".join(row[i].ljust(w) for i, w in zip(keep, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(([f"machine: {machine}"] if machine else []) + lines)


def write_json(records: list[Record], path: Path, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "records": [asdict(r) for r in records]}, indent=1) + "\n")
