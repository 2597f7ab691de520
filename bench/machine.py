"""The machine a benchmark ran on, as its records name it: the CPU model (lscpu's), its core count, and the
XLA_FLAGS of the run (XLA's defaults unless the user set some)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU model as /proc/cpuinfo (lscpu) names it, with its family and model numbers where they help tell
    hosts of one name apart, e.g. 'AMD EPYC (family 25, model 17)'."""
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
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


def describe() -> str:
    """'AMD EPYC (family 25, model 17), 2 cores; XLA_FLAGS: none'."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"{cpu_model()}, {cores} cores; XLA_FLAGS: {os.environ.get('XLA_FLAGS') or 'none'}"
