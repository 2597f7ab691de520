"""Compile targets: a TPU slice or a GPU node set, as compile-only devices of the chip's own compiler.

TPU slices are named as Google names them: `v4-8`, `v5e-8` (also `v5litepod-8`), `v5p-128`, `v6e-64`. The
number counts TensorCores for v4 and v5p (two per chip: v4-8 is 4 chips) and chips for v5e and v6e. A raw
topology such as `v5e:4x4` or `v5p:2x2x2` names the chips directly. libtpu (`pip install -e '.[tpu]'`) makes
their devices (`jax.experimental.topologies.get_topology_desc`); hosts are 4 chips each, except the single
8-chip hosts of v5e-8 and v6e-8, and `slices` repeats the slice over a data-center network.

GPU node sets: `h100-8`, `h200-8`, `a100-8`, `b200-8` (one host of 8) and `h100-16` (two hosts of 8): XLA's GPU
compiler (the CUDA plugin, `pip install -e '.[gpu-compile]'`) with the chip's target configuration, a
GpuTargetConfigProto from XLA's own specs (train/aot/gpu_targets/, each file naming its source).

Usable memory per chip is the compiler's own limit: for a TPU, the HBM the compiler reports as available when
it refuses a buffer larger than any chip (`_tpu_usable`); for a GPU, the device memory of the target
configuration, less the 25% JAX's allocator leaves to the CUDA runtime (XLA_PYTHON_CLIENT_MEM_FRACTION's
default of 0.75): the memory a process on that GPU can give XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from pathlib import Path
from typing import Any

from train.errors import ConfigError, UsageError

SPECS = Path(__file__).resolve().parent / "gpu_targets"
# Google's generation name -> (topology prefix, cores per chip, dimensions of its topology)
_TPUS = {"v4": ("v4", 2, 3), "v5p": ("v5", 2, 3), "v5e": ("v5e", 1, 2), "v5litepod": ("v5e", 1, 2),
         "v6e": ("v6e", 1, 2)}
_TPU_PREFIXES = {"v4": "v4", "v5": "v5p", "v5p": "v5p", "v5e": "v5e", "v6e": "v6e"}
# GPU name -> (target configuration file, GPUs per host)
_GPUS = {"h100": ("h100_sxm", 8), "h200": ("h200", 8), "a100": ("a100_sxm_80", 8), "b200": ("b200", 8)}
GPU_MEMORY_FRACTION = 0.75  # JAX's default share of a GPU's memory for XLA (XLA_PYTHON_CLIENT_MEM_FRACTION)
INSTALL = {"tpu": "pip install -e '.[tpu]' (libtpu, about 700 MB)",
           "cuda": "pip install -e '.[gpu-compile]' in a venv of its own (the CUDA plugin, cuDNN and cuBLAS, "
                   "about 2.5 GB; docs/accelerators.md)"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it
    platform: str  # 'tpu' or 'cuda'
    chips: int
    hosts: int
    slices: int
    topology: str  # the topology string the compiler takes
    options: tuple[tuple[str, Any], ...] = ()  # further get_topology_desc arguments

    @property
    def generation(self) -> str:
        return self.topology.split(":")[0] if self.platform == "tpu" else self.name.split("-")[0]

    def describe_chips(self, chip: str) -> str:
        """'v5e-8 (8 x TPU v5 lite, 1 host)'."""
        slices = f" in {self.slices} slices" if self.slices > 1 else ""
        return f"{self.name} ({self.chips} x {chip}{slices}, {self.hosts} host{'s' if self.hosts > 1 else ''})"


def parse(name: str, slices: int = 1) -> Target:
    """The target `name` names (UsageError, one line, for a name that is none)."""
    if slices < 1:
        raise UsageError(f"--slices {slices}: pass a whole number >= 1")
    text = name.strip().lower()
    if m := re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", text):
        generation, count = m[1], int(m[2])
        prefix, cores, dims = _TPUS[generation]
        if count % cores or count < cores:
            raise UsageError(f"--target {name}: a {generation} slice counts {cores} cores per chip, so its number is "
                             f"a multiple of {cores} (e.g. {generation}-{8 * cores // 2})")
        chips = count // cores
        shape = _grid(chips, dims)
        if shape is None:
            counts = ", ".join(f"{generation}-{c * cores}" for c in _SHAPES[dims])
            raise UsageError(f"--target {name}: no {generation} slice has {chips} chips: use one of {counts}")
        return _tpu(name, prefix, shape, slices)
    if m := re.fullmatch(r"(v4|v5|v5p|v5e|v6e):(\d+(?:x\d+){1,2})", text):
        generation = _TPU_PREFIXES[m[1]]
        prefix, _, dims = _TPUS[generation]
        shape = tuple(int(x) for x in m[2].split("x"))
        if len(shape) != dims or min(shape) < 1:
            raise UsageError(f"--target {name}: a {generation} topology has {dims} dimensions, e.g. "
                             f"{prefix}:{'x'.join(['2'] * dims)}")
        return _tpu(name, prefix, shape, slices)
    if m := re.fullmatch(r"(h100|h200|a100|b200)-(\d+)", text):
        per_host = _GPUS[m[1]][1]
        count = int(m[2])
        if count < 1 or (count > per_host and count % per_host):
            raise UsageError(f"--target {name}: GPUs come {per_host} to a host: pass up to {per_host}, or a multiple "
                             f"of {per_host} ({m[1]}-{2 * per_host} is two hosts)")
        hosts = max(1, count // per_host)
        return Target(name, "cuda", count * slices, hosts * slices, slices,
                      f"{slices}x{hosts}x{min(count, per_host)}")
    raise UsageError(f"--target {name}: not a TPU slice or GPU node set: use e.g. v5e-8, v4-8, v5p-128, v6e-64, a "
                     "topology such as v5e:4x4, or h100-8, h200-8, a100-8, b200-8, h100-16")


# Google's slice shapes by chip count: 2-D for v5e and v6e, 3-D for v4 and v5p.
_SHAPES: dict[int, dict[int, tuple[int, ...]]] = {
    2: {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)},
    3: {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8),
        512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16), 4096: (16, 16, 16)},
}


def _grid(chips: int, dims: int) -> tuple[int, ...] | None:
    return _SHAPES[dims].get(chips)


def _tpu(name: str, prefix: str, shape: tuple[int, ...], slices: int) -> Target:
    chips = math.prod(shape)
    single_host = chips <= 8 and len(shape) == 2  # v5e-8 and v6e-8 are one 8-chip host
    per_host = shape if single_host else (min(shape[0], 2), min(shape[1], 2), *([1] if len(shape) == 3 else []))
    hosts = chips // math.prod(per_host)
    options: list[tuple[str, Any]] = [("chips_per_host_bounds", tuple(per_host) + (() if len(shape) == 3 else (1,)))]
    if prefix in ("v4", "v5"):
        options.append(("chip_config_name", "megacore"))  # one device per chip, as on a real v4 or v5p
    if len(shape) == 3 and min(shape) >= 4:
        options.append(("wrap", (True, True, True)))  # a full cube is a torus
    elif len(shape) == 2 and shape == (16, 16):
        options.append(("wrap", (True, True, False)))  # a full v5e or v6e pod
    if slices > 1:
        options.append(("num_slices", slices))
    return Target(name, "tpu", chips * slices, hosts * slices, slices, f"{prefix}:{'x'.join(map(str, shape))}",
                  tuple(options))


def accelerator_type(target: Target) -> str:
    """The slice as Cloud TPU's accelerator types name it (v5litepod-8, v4-8, ...)."""
    prefix = target.topology.split(":")[0]
    name = {"v4": "v4", "v5": "v5p", "v5e": "v5litepod", "v6e": "v6e"}[prefix]
    per_slice = target.chips // target.slices
    return f"{name}-{per_slice * (2 if prefix in ('v4', 'v5') else 1)}"


def compiler_installed(platform: str) -> bool:
    if platform == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def check_compiler(target: Target) -> None:
    """UsageError (exit 2) naming the install when the target's compiler is not in this environment."""
    if not compiler_installed(target.platform):
        chip = "TPU" if target.platform == "tpu" else "GPU"
        raise UsageError(f"--target {target.name} needs the {chip} compiler, which is not installed: "
                         f"{INSTALL[target.platform]}")


def devices(target: Target) -> list[Any]:
    """The target's compile-only devices, in the topology's order."""
    from jax.experimental import topologies

    if target.platform == "tpu":
        # Before libtpu loads: several processes may hold it at once (its lockfile otherwise refuses the
        # second); and the TPU type and workers it would look up are given, so it initializes for compiling
        # without warnings on stderr.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type(target))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

    try:
        if target.platform == "tpu":
            desc = topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **dict(target.options))
        else:
            spec = _gpu_spec(target)
            desc = topologies.get_topology_desc(target.generation, "cuda", target_config=spec,
                                                topology=target.topology)
    except Exception as err:  # the compiler's own refusal of a topology, in one line
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ConfigError(f"--target {target.name}: the {target.platform.upper()} compiler refuses the topology "
                          f"{target.topology} ({first[:160]}): pick a slice Google offers") from None
    return list(desc.devices)


def _gpu_spec(target: Target) -> str:
    return (SPECS / f"{_GPUS[target.generation][0]}.txtpb").read_text()


def usable_bytes(target: Target, device: Any) -> int:
    """Memory per chip the program may use: the compiler's limit (module docstring)."""
    if target.platform == "cuda":
        memory = int(re.search(r"device_memory_size: (\d+)", _gpu_spec(target))[1])  # type: ignore[index]
        return int(memory * GPU_MEMORY_FRACTION)
    return _tpu_usable(device)


@functools.lru_cache(maxsize=8)
def _tpu_usable(device: Any) -> int:
    """The HBM the TPU compiler says is available, read off its refusal of a buffer no chip holds (~0.1 s)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())
    huge = jax.ShapeDtypeStruct((1 << 38,), jnp.float32, sharding=sharding)  # 1 TiB
    try:
        jax.jit(lambda a: a.sum()).lower(huge).compile()
    except Exception as err:
        oom = parse_oom(str(err))
        if oom is not None:
            return int(oom[1])
    raise ConfigError(f"the TPU compiler did not say how much HBM a {device.device_kind} has: libtpu may be newer "
                      "than this code knows; pin jax[tpu] to the version pyproject.toml names")


_OOM = (
    re.compile(r"total memory required for HLO temporaries \((?P<used>[\d.]+[KMGT]?)\)"
               r" exceeds available HBM \((?P<limit>[\d.]+[KMGT]?)\)"),
    re.compile(r"Used (?P<used>[\d.]+[KMGT]?) of (?P<limit>[\d.]+[KMGT]?) hbm"),
    re.compile(r"memory required \((?P<used>[\d.]+[KMGT]?)\) exceeds available (?:HBM )?\((?P<limit>[\d.]+[KMGT]?)\)"),
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_oom(message: str) -> tuple[float, float] | None:
    """(bytes needed, bytes available) from a compiler's out-of-memory message, else None."""
    for pattern in _OOM:
        if m := pattern.search(message):
            return _bytes(m["used"]), _bytes(m["limit"])
    return None


def _bytes(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)([KMGT]?)", text)
    assert m is not None
    return float(m[1]) * _UNITS[m[2]]
