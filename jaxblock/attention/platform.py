"""Where the attention kernels will run: the target platform and the ambient mesh layout.

Kernels are picked for the platform the program is *lowered for*, not the one tracing it: a TPU export
traced on a CPU host must get TPU kernels, while `jax.default_backend()` still says 'cpu' there.
`target_platform()` is that platform: `jax.default_backend()` unless `for_platform(...)` says otherwise
(`python -m train lower` and `train export` set it while they trace).

Kernels that run per shard (splash attention on TPU, the context-parallel kernels) read the mesh from
JAX's ambient abstract mesh (`jax.set_mesh` / `jax.sharding.use_abstract_mesh`, set by `train/`) and map
their logical axes ('batch', 'length', 'heads', 'kv_heads') to mesh axes through Flax's logical axis rules
(`flax.linen.logical_axis_rules`, also set by `train/`). jaxblock itself never builds a mesh: without
an ambient mesh every kernel runs on the whole arrays.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}
_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxblock_attention_target", default=None)


def platform_name(name: str) -> str:
    """'cpu', 'gpu' or 'tpu' for a JAX platform or backend name ('cuda' and 'rocm' are 'gpu')."""
    try:
        return _ALIASES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown platform {name!r}: use one of cpu, cuda, tpu") from None


def target_platform() -> str:
    """The platform the kernels are chosen for: the one `for_platform` names, else the default backend."""
    return _TARGET.get() or platform_name(jax.default_backend())


@contextlib.contextmanager
def for_platform(name: str) -> Iterator[str]:
    """Trace for `name` ('cpu', 'gpu'/'cuda', 'tpu') whatever backend this process runs on."""
    token = _TARGET.set(platform_name(name))
    try:
        yield _TARGET.get() or name
    finally:
        _TARGET.reset(token)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """The ambient mesh, the mesh axes of each logical axis of q [N, L, H, K] and those of the parameters' model
    axis `embed` (FSDP's), each () where that axis is not split."""

    mesh: Any  # jax.sharding.AbstractMesh
    batch: tuple[str, ...]
    length: tuple[str, ...]
    heads: tuple[str, ...]
    kv_heads: tuple[str, ...]
    embed: tuple[str, ...] = ()

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @staticmethod
    def entry(axes: tuple[str, ...]) -> Any:
        """A PartitionSpec entry for these axes."""
        return None if not axes else axes[0] if len(axes) == 1 else axes


def mesh_layout() -> MeshLayout | None:
    """The ambient mesh with more than one device and where the attention axes live on it, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or math.prod(mesh.shape.values()) == 1:
        return None
    rules = nn.get_logical_axis_rules()

    def axes(logical: str) -> tuple[str, ...]:
        spec = nn.logical_to_mesh_axes((logical,), rules) if rules else None
        entry = None if spec is None else spec[0]
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        return tuple(a for a in names if a in mesh.shape and mesh.shape[a] > 1)

    return MeshLayout(mesh, axes("batch"), axes("length"), axes("heads"), axes("kv_heads"), axes("embed"))
