"""The per-session metadata that goes into run.json: versions, devices, host, command and git commit."""

from __future__ import annotations

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

    from jaxblock import xla_options

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
        "xla_options": xla_options.current().as_dict(),  # CPU model and the XLA option set this session used
    }
