"""Which JAX platforms a command starts, set before JAX loads: the accelerators this host has, never a
compiler plugin's chip it lacks.

An environment that holds the TPU compiler (libtpu, the `[tpu]` extra) or the CUDA plugin (the
`[gpu-compile]` extra) to compile for a chip on a host without one would otherwise have JAX start that
plugin in every command: libtpu writes warnings about the TPU it cannot find, the CUDA plugin a traceback.
So when JAX_PLATFORMS is unset, a plugin whose chip this host lacks is left out: JAX_PLATFORMS becomes the
platforms present (a TPU: a PCI device of Google's vendor id; an NVIDIA GPU: /dev/nvidia0) plus cpu. On a TPU
VM or a GPU machine nothing changes. `compile` and `lower` never run on an accelerator: they compile for
compile-only devices (train/aot/), so they run on cpu, with JAX's check of the CUDA libraries against a GPU
skipped. A JAX_PLATFORMS of the user's own is always kept.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator, MutableMapping
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (as jax's own detection reads them)
AHEAD_OF_TIME = ("compile", "lower")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def _has_tpu() -> bool:
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def _has_nvidia_gpu() -> bool:
    return Path("/dev/nvidia0").exists()


def choose(command: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set env's JAX_PLATFORMS for `command` as the module docstring says; return what was set (None: nothing)."""
    if "JAX_PLATFORMS" in env:
        return None
    if command in AHEAD_OF_TIME:
        env.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        env["JAX_PLATFORMS"] = "cpu"
        return "cpu"
    tpu_plugin, cuda_plugin = _installed("libtpu"), _installed("jax_plugins.xla_cuda12")
    if not (tpu_plugin or cuda_plugin):
        return None
    has_tpu, has_gpu = tpu_plugin and _has_tpu(), cuda_plugin and _has_nvidia_gpu()
    if (tpu_plugin and not has_tpu) or (cuda_plugin and not has_gpu):
        present = [name for name, here in (("tpu", has_tpu), ("cuda", has_gpu)) if here]
        env["JAX_PLATFORMS"] = ",".join([*present, "cpu"])
        return env["JAX_PLATFORMS"]
    return None


# What the CUDA plugin's libraries log on a host without a GPU when JAX loads them (absl, before any log
# setup): expected there, and nothing a user of `compile` or `lower` acts on.
_NATIVE_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
                           r"|I\d{4} .*cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine.*)$")


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """While JAX loads its plugins (fd 2 written by native code, not Python): hold back the plugins' expected
    start-up lines on a host without their chip, and pass every other line on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = passed_on(held.read().decode(errors="replace"))
            if kept:
                print(kept, file=sys.stderr)


def passed_on(native: str) -> str:
    """What native code wrote to fd 2, less the plugins' expected start-up lines on a host without their chip."""
    return "\n".join(line for line in native.splitlines() if not _NATIVE_NOISE.match(line))


def start_jax(*, filtered: bool = True) -> None:
    """Import JAX and start its backends with the plugins' expected start-up lines held back (filtered=False:
    fd 2 is left as it is, for a process whose fd 2 another process reads and filters, train/aot/isolate.py:
    a native library that exits at start-up, e.g. on a flag it does not know, then still has its line read)."""
    with native_stderr_filtered() if filtered else contextlib.nullcontext():
        import jax

        jax.devices()
