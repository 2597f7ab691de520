"""Fixtures of the compile tests."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="session")
def gpu_python() -> str:
    """The GPU compiler's venv (.venv-gpu at the checkout's root), created as docs/accelerators.md says if absent."""
    venv = ROOT / ".venv-gpu"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([str(ROOT / "bench" / "gpu_compiler_venv.sh"), str(venv)], check=True, timeout=1800)
    return str(python)
