"""The device mesh and where each parameter lives on it (used by train/devices/runners.py's sharded runner).

Mesh axes (data, fsdp, context, tensor); parameters carry logical axis names (e.g. 'embed', 'mlp', 'heads') from
their Flax init, mapped to mesh axes by `parallel.rules`; optimizer state follows its parameters.
"""

from __future__ import annotations

import math
from typing import Any, cast

import flax.linen as nn
import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from train.config import MESH_AXES, ConfigError, ParallelConfig
from train.loop.state import TrainState


def mesh_shape(cfg: ParallelConfig, device_count: int) -> tuple[int, ...]:
    """The sizes of MESH_AXES (data, fsdp, context, tensor) with -1 resolved; the product must be the device count."""
    sizes = [getattr(cfg.mesh, axis) for axis in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if device_count % fixed:
            raise ConfigError(
                f"parallel.mesh {dict(zip(MESH_AXES, sizes, strict=True))} does not divide {device_count} "
                "devices: pick axis sizes whose product divides the device count"
            )
        sizes[sizes.index(-1)] = device_count // fixed
    if math.prod(sizes) != device_count:
        raise ConfigError(
            f"parallel.mesh {dict(zip(MESH_AXES, sizes, strict=True))} needs {math.prod(sizes)} devices but "
            f"{device_count} are present: make the product equal the device count or set one axis to -1"
        )
    return tuple(sizes)


def make_mesh(cfg: ParallelConfig, devices: list[Any] | None = None) -> Mesh:
    """The mesh of `devices`. Over several TPU slices (devices with distinct `slice_index`), the slices split
    the first of data, fsdp that they divide: those axes' collectives are once a step, fit for the data-center
    network between slices; context and tensor stay within a slice."""
    devices = devices or jax.devices()
    shape = mesh_shape(cfg, len(devices))
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    from jax.experimental import mesh_utils

    axis = next((i for i in range(2) if shape[i] % slices == 0), None)
    if axis is None:
        raise ConfigError(
            f"parallel.mesh {dict(zip(MESH_AXES, shape, strict=True))} over {slices} slices: the slices split "
            f"the data or fsdp axis, and neither is a multiple of {slices}: make one of them a multiple of it"
        )
    dcn = tuple(slices if i == axis else 1 for i in range(len(shape)))
    per_slice = tuple(s // d for s, d in zip(shape, dcn, strict=True))
    grid = mesh_utils.create_hybrid_device_mesh(per_slice, dcn, devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def logical_rules(cfg: ParallelConfig) -> tuple[tuple[str, Any], ...]:
    return tuple((name, axes) for name, axes in cfg.rules)


def param_shardings(specs: Any, params: Any, mesh: Mesh, rules: Any) -> tuple[Any, list[str]]:
    """NamedSharding per param leaf, and a note for each dim left replicated because its mesh axes
    do not divide it (e.g. a 259-token vocabulary over tensor=2): such a dim is replicated rather
    than refused, so every config runs on every mesh; the notes say what it costs."""
    notes: list[str] = []
    flat_specs, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    treedef = cast(Any, treedef)
    flat_params = treedef.flatten_up_to(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    out = []
    for path, logical, leaf in zip(paths, flat_specs, flat_params, strict=True):
        axes = list(nn.logical_to_mesh_axes(tuple(logical), rules) or ())
        for dim, entry in enumerate(axes):
            names = entry if isinstance(entry, tuple) else (entry,)
            size = math.prod(mesh.shape[a] for a in names if a is not None)
            if size > 1 and leaf.shape[dim] % size:
                notes.append(f"{path} dim {dim} ({leaf.shape[dim]}) over {entry} ({size})")
                axes[dim] = None
        out.append(NamedSharding(mesh, PartitionSpec(*axes)))
    return treedef.unflatten(out), notes


def state_shardings(state: TrainState, params_sh: Any, mesh: Mesh) -> TrainState:
    """Shardings for a whole TrainState: optimizer leaves that mirror a parameter (Adam moments,
    accumulated gradients) take that parameter's sharding; counters are replicated.

    A mirror is found by its path, which ends with its parameter's path (`...mu['encoder']['embedding']`),
    and its shape. (optax.tree_map_params cannot do it with optim.freeze: it initializes the optimizer on a
    placeholder, which the freeze labels cannot name, and frozen parameters have no moments.)"""
    replicated = NamedSharding(mesh, PartitionSpec())
    flat_sh = jax.tree.leaves(params_sh, is_leaf=lambda x: isinstance(x, NamedSharding))
    by_path = sorted(
        ((jax.tree_util.keystr(path), tuple(leaf.shape), sh)
         for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(state.params)[0], flat_sh, strict=True)),
        key=lambda entry: -len(entry[0]),
    )

    def mirror(path: Any, leaf: Any) -> NamedSharding:
        key, shape = jax.tree_util.keystr(path), tuple(getattr(leaf, "shape", ()))
        return next((sh for name, s, sh in by_path if shape == s and key.endswith(name)), replicated)

    opt_sh = jax.tree_util.tree_map_with_path(mirror, state.opt_state)
    return state.replace(step=replicated, params=params_sh, opt_state=opt_sh)


