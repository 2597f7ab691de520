"""The per-session metadata that goes into run.json: versions, devices, host, command and git commit."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_metadata(start_step: int) -> dict[str, Any]:
    """One session's record for run.json: when, what ran it, versions, devices, git commit."""
    import flax
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint

    return {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "start_step": start_step,
        "argv": sys.argv,
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "orbax-checkpoint": orbax.checkpoint.__version__, "numpy": np.__version__},
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
        "git_commit": _git_commit(),
        "cpu": _cpu_model(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it ('model name'), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
