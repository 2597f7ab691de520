"""Where the step is compiled and data is placed: the only module that knows about devices and hosts.

`make_runner(config, state, task=..., specs=...)` returns a Runner for `parallel.strategy`:
- single:  jax.jit(train_step, donate_argnums=0) on one device.
- pmap:    jax.pmap over every device: replicated state, one batch shard per device, the gradient
           reduced inside the step (`train.loop.step.loss_and_grads`), a dropout key per device.
- sharded: jax.jit with NamedSharding over a Mesh with axes (data, fsdp, context, tensor). Parameters are
           placed by their logical axis names through `parallel.rules` (the logical specs come from the
           run's one abstract init, train/loop/state.py `abstract_init`); optimizer state follows its
           parameters; the batch is split over (data, fsdp) and its [N, L] arrays along L over context
           (padded to a multiple of it). XLA inserts the collectives; the context-parallel attention
           (jaxblock/attention/context.py) brings its own.

Batches arrive as host numpy dicts holding this process's contiguous share of the global batch
(`Runner.data_share()` says which share); the runner assembles the global array. `train.batch_size`
is the global batch, so every layout computes the same numbers (tests/train/devices/test_runners.py).
The runner also owns every gather to the host (`fetch`, `host_params`). Multi-host: the run module calls
`initialize_distributed(config.parallel)` once, before anything touches a device; every process then
runs the same program, only `is_primary()` logs, and all processes save checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from train.config import Config, ConfigError
from train.devices.hosts import host_value, is_primary
from train.devices.mesh import logical_rules, make_mesh, mesh_shape, param_shardings, state_shardings
from train.devices.steps import kernel_context, mesh_steps
from train.loop.state import TrainState
from train.loop.step import Metrics, eval_step, train_step
from train.tasks import CLASSIFICATION, Task

log = logging.getLogger(__name__)

PMAP_AXIS = "batch"
Batch = dict[str, np.ndarray]


# --- runners -----------------------------------------------------------------------------------------


class Runner:
    """Compiled steps plus placement and gathers (the only interface the loop uses). Strategy `single`.

    Built from the config, the task (whose step it compiles), the state's shapes and, for `sharded`,
    the parameters' logical PartitionSpecs.
    """

    strategy = "single"

    def __init__(self, config: Config, state: TrainState, task: Task = CLASSIFICATION, specs: Any = None) -> None:
        self.device = jax.devices()[0]
        self.pad_values = task.pad_values
        self._train = jax.jit(functools.partial(train_step, task), donate_argnums=0)
        self._eval = jax.jit(functools.partial(eval_step, task))

    def data_parallel_size(self) -> int:
        """Devices that each compute on a slice of the batch (train.batch_size must be a multiple)."""
        return 1

    def data_share(self) -> tuple[int, int]:
        """(index, count): this process loads share `index` of `count` contiguous shares of a batch
        (pass them to train.data.labelled as process_index, process_count)."""
        return 0, 1

    def place_state(self, state: TrainState) -> TrainState:
        return jax.device_put(jax.tree.map(host_value, state), self.device)

    def init_state(self, make_state: Callable[[], TrainState]) -> TrainState:
        """Build the state where it lives (sharded from the start under `sharded`)."""
        return self.place_state(jax.jit(make_state)())

    def place_batch(self, batch: Batch) -> Any:
        return jax.device_put(self._pad(batch))

    def train_step(self, state: TrainState, batch: Batch, rng: jax.Array) -> tuple[TrainState, Metrics]:
        return self._train(state, self.place_batch(batch), rng)

    def eval_step(self, state: TrainState, batch: Batch) -> Metrics:
        return self._eval(state, self.place_batch(batch))

    def unreplicate(self, state: TrainState) -> TrainState:
        """A state of ordinary jax.Arrays without a device axis, which Orbax saves from every process."""
        return state

    def fetch(self, tree: Any) -> Any:
        """Host numpy copies of (replicated) results such as metrics; each process reads its local copy."""
        return jax.device_get(jax.tree.map(host_value, tree))

    def host_params(self, state: TrainState) -> Any:
        """The parameters as host arrays, gathered from every process when sharded across hosts (every
        process must call this together)."""
        params = self.unreplicate(state).params
        if not all(x.is_fully_addressable for x in jax.tree.leaves(params)):
            params = multihost_utils.process_allgather(params, tiled=True)
        return jax.device_get(params)

    def abstract_state(self, state: TrainState) -> TrainState:
        """Orbax restore target: shapes, dtypes and this layout's shardings for `unreplicate(state)`
        (pass a host state or jax.eval_shape of one)."""
        sh = SingleDeviceSharding(self.device)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)

    def _local_rows_multiple(self) -> int:
        return 1

    def _pad(self, batch: Batch) -> Batch:
        """Pad this process's rows to a multiple of its devices with empty rows (no valid tokens, the
        task's fill for its targets, e.g. label -1), which count nowhere (the step divides by the count)."""
        rows = len(batch["tokens"])
        missing = -rows % self._local_rows_multiple()
        if not missing:
            return batch
        out = {}
        for key, value in batch.items():
            fill = self.pad_values.get(key, 0)
            pad = np.full((missing, *value.shape[1:]), fill, value.dtype)
            out[key] = np.concatenate([np.asarray(value), pad])
        return out


class PmapRunner(Runner):
    strategy = "pmap"

    def __init__(self, config: Config, state: TrainState, task: Task = CLASSIFICATION, specs: Any = None) -> None:
        self.devices = jax.devices()
        self.local_devices = jax.local_devices()
        self.pad_values = task.pad_values
        _check_batch_size(config, len(self.devices), "pmap uses every device")

        def step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, Metrics]:
            # A dropout key per device: the same key would drop the same units in every shard.
            rng = jax.random.fold_in(rng, jax.lax.axis_index(PMAP_AXIS))
            return train_step(task, state, batch, rng, axis_name=PMAP_AXIS)

        # Metrics are reduced inside the step, so they come back once, not per device.
        self._train = jax.pmap(step, PMAP_AXIS, in_axes=(0, 0, None), out_axes=(0, None), donate_argnums=0)
        self._eval = jax.pmap(
            lambda s, b: eval_step(task, s, b, axis_name=PMAP_AXIS), PMAP_AXIS, in_axes=(0, 0), out_axes=None
        )
        self._replicated = NamedSharding(Mesh(np.array(self.devices), ("devices",)), PartitionSpec())
        self._stacked = NamedSharding(Mesh(np.array(self.local_devices), (PMAP_AXIS,)), PartitionSpec(PMAP_AXIS))

    def data_parallel_size(self) -> int:
        return len(self.devices)

    def data_share(self) -> tuple[int, int]:
        return jax.process_index(), jax.process_count()

    def place_state(self, state: TrainState) -> TrainState:
        # The same layout pmap gives its outputs, so the second step reuses the first one's program.
        n = len(self.local_devices)

        def put(x: Any) -> jax.Array:
            host = np.asarray(host_value(x))
            return jax.device_put(np.broadcast_to(host, (n, *host.shape)), self._stacked)

        return jax.tree.map(put, state)

    def place_batch(self, batch: Batch) -> Any:
        n = len(self.local_devices)
        return {k: np.asarray(v).reshape(n, -1, *v.shape[1:]) for k, v in self._pad(batch).items()}

    def _local_rows_multiple(self) -> int:
        return len(self.local_devices)

    def unreplicate(self, state: TrainState) -> TrainState:
        """Drop the device axis: one copy (through the host, as a checkpoint goes there anyway) becomes
        a global, fully replicated array that Orbax saves once whatever the host count."""

        def one(x: jax.Array) -> jax.Array:
            host = np.asarray(x.addressable_shards[0].data)[0]
            return jax.make_array_from_callback(host.shape, self._replicated, lambda idx: host[idx])

        return jax.tree.map(one, state)

    def abstract_state(self, state: TrainState) -> TrainState:
        sh = self._replicated
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state)


class ShardedRunner(Runner):
    strategy = "sharded"

    def __init__(self, config: Config, state: TrainState, task: Task = CLASSIFICATION, specs: Any = None,
                 devices: list[Any] | None = None) -> None:
        """devices: the mesh's devices (default: every device); the benchmarks compare meshes of a few."""
        cfg = config.parallel
        if specs is None:
            raise ValueError("the sharded runner needs the params' logical specs (train.loop.state.abstract_init)")
        self.pad_values = task.pad_values
        self.mesh = make_mesh(cfg, devices)
        self.rules = logical_rules(cfg)
        batch_axes, length_axes = nn.logical_to_mesh_axes(("batch", "length"), self.rules) or (None, None)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(batch_axes))
        # Arrays with a token axis ([N, L, ...]) split along L too: context parallelism.
        self.token_sharding = NamedSharding(self.mesh, PartitionSpec(batch_axes, length_axes))
        self.context = math.prod(self.mesh.shape[a] for a in _axes_of(length_axes))
        self.context_strategy = cfg.context_strategy
        self._padded_lengths: set[int] = set()
        _check_lengths(config, self.context)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        _check_batch_size(config, self.data_parallel_size(), f"mesh axes {batch_axes}")
        self._check_share()

        spec_tree: Any = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        if spec_tree != jax.tree.structure(state.params):
            raise ConfigError("the state's params do not match config.model: build the state from the same config")
        params_sh, self.replicated_dims = param_shardings(specs, state.params, self.mesh, self.rules)
        if self.replicated_dims and is_primary():
            log.warning(
                "parallel: %d param dims are replicated (size not divisible by their mesh axes): %s",
                len(self.replicated_dims), "; ".join(self.replicated_dims),
            )
        self.state_sharding = state_shardings(state, params_sh, self.mesh)
        self._flat_sharding = jax.tree.leaves(self.state_sharding)
        # Inputs arrive committed (place_state, place_batch); outputs are pinned inside the program.
        self._train, self._eval = mesh_steps(task, self.mesh, self.rules, self.context_strategy, self._flat_sharding)

    def kernel_context(self) -> contextlib.ExitStack:
        """What is ambient while this runner's steps are traced (train/devices/steps.py `kernel_context`)."""
        return kernel_context(self.mesh, self.rules, self.context_strategy)

    def shardings_like(self, state: TrainState) -> TrainState:
        """This layout's shardings in the tree structure of `state` (any state of the config's shape)."""
        treedef: Any = jax.tree.structure(state)
        if treedef.num_leaves != len(self._flat_sharding):
            raise ConfigError(
                f"the state has {treedef.num_leaves} leaves but this runner was built for "
                f"{len(self._flat_sharding)}: build the state and the runner from the same config"
            )
        return jax.tree.unflatten(treedef, self._flat_sharding)

    def _pin(self, state: TrainState) -> TrainState:
        return jax.lax.with_sharding_constraint(state, self.shardings_like(state))

    def data_parallel_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in _axes_of(self.batch_sharding.spec[0]))

    def _local_slices(self) -> list[int]:
        """Batch shard indices (of data_parallel_size) held by this process's devices."""
        n = self.data_parallel_size()
        index_map = self.batch_sharding.addressable_devices_indices_map((n,))
        return sorted({cast(tuple[slice, ...], idx)[0].indices(n)[0] for idx in index_map.values()})

    def _check_share(self) -> None:
        """Each process must hold batch shard block `process_index` of `process_count`, the share
        train.data.labelled loads for it; a mesh with `tensor` spanning hosts would not."""
        held = self._local_slices()
        contiguous = held == list(range(held[0], held[0] + len(held)))
        # Each process loads whole rows, so its devices must hold every context shard of them.
        rows_by_shard = self.token_sharding.addressable_devices_indices_map((self.data_parallel_size(), self.context))
        spans = {cast(tuple[slice, ...], idx)[1].indices(self.context)[0] for idx in rows_by_shard.values()}
        whole_rows = len(spans) == self.context
        if not contiguous or not whole_rows or self.data_share() != (jax.process_index(), jax.process_count()):
            raise ConfigError(
                f"process {jax.process_index()} of {jax.process_count()} holds batch shards {held} of "
                f"{self.data_parallel_size()}, not its own contiguous share of whole rows: keep parallel.mesh.tensor "
                "and parallel.mesh.context within one host and split hosts over data/fsdp"
            )

    def data_share(self) -> tuple[int, int]:
        held = self._local_slices()
        return held[0] // len(held), self.data_parallel_size() // len(held)

    def _local_rows_multiple(self) -> int:
        return len(self._local_slices())

    def place_state(self, state: TrainState) -> TrainState:
        def put(x: Any, sh: NamedSharding) -> jax.Array:
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim):
                return x  # e.g. restored straight into this layout
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return jax.device_put(x, sh)  # global in another layout: reshard on device
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

        return jax.tree.map(put, state, self.shardings_like(state))

    def init_state(self, make_state: Callable[[], TrainState]) -> TrainState:
        return jax.jit(lambda: self._pin(make_state()))()

    def place_batch(self, batch: Batch) -> Any:
        batch = self._pad(self._pad_length(batch))
        shape = np.shape(batch["tokens"])
        return {
            k: jax.make_array_from_process_local_data(
                self.token_sharding if np.shape(v)[:2] == shape else self.batch_sharding, np.asarray(v)
            )
            for k, v in batch.items()
        }

    def _pad_length(self, batch: Batch) -> Batch:
        """Pad the token axis of every [N, L, ...] array to a multiple of the context size: positions past the
        end, not valid tokens (the task's fill for its targets, -1 segment ids), so masked everywhere."""
        shape = np.shape(batch["tokens"])
        missing = -shape[1] % self.context
        if not missing:
            return batch
        if shape[1] not in self._padded_lengths and is_primary():
            log.warning("parallel: sequences of %d tokens are padded to %d (a multiple of parallel.mesh.context=%d); "
                        "the added positions are masked", shape[1], shape[1] + missing, self.context)
        self._padded_lengths.add(shape[1])
        out = {}
        for key, value in batch.items():
            value = np.asarray(value)
            if value.shape[:2] == shape:
                pad = np.full((shape[0], missing, *value.shape[2:]), self.pad_values.get(key, 0), value.dtype)
                value = np.concatenate([value, pad], axis=1)
            out[key] = value
        return out

    def train_step(self, state: TrainState, batch: Batch, rng: jax.Array) -> tuple[TrainState, Metrics]:
        return self._train(state, self.place_batch(batch), self._place_key(rng))

    def _place_key(self, rng: jax.Array) -> jax.Array:
        """Every process derives the same key: one copy per local device makes it a global replicated
        array (device_put cannot target other hosts' devices; no host round trip stalls the queue)."""
        if isinstance(rng, jax.Array) and rng.sharding == self.replicated:
            return rng
        local = host_value(rng)
        copies = [jax.device_put(local, d) for d in self.mesh.local_devices]
        return jax.make_array_from_single_device_arrays(local.shape, self.replicated, copies)

    def abstract_state(self, state: TrainState) -> TrainState:
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, self.shardings_like(state)
        )


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def _check_lengths(config: Config, context: int) -> None:
    """Every sequence length the run's batches may have, padded to a multiple of `context`, must stay within
    model.max_len (the positions the model has)."""
    if context == 1:
        return
    longest = config.model.max_len
    for length in sorted({*config.data.buckets, config.data.max_len}):
        padded = -(-length // context) * context
        if length <= longest < padded:
            raise ConfigError(
                f"parallel.mesh.context={context} pads sequences of {length} tokens to {padded}, beyond "
                f"model.max_len={longest}: use data.buckets and data.max_len that are multiples of {context}, "
                "or a context size that divides them"
            )


def _check_batch_size(config: Config, parallel: int, where: str) -> None:
    size = config.train.batch_size
    if size % parallel:
        raise ConfigError(
            f"train.batch_size={size} (global) does not split over {parallel} data-parallel devices ({where}): "
            f"use a multiple of {parallel}"
        )


def make_runner(config: Config, state: TrainState, *, task: Task = CLASSIFICATION, specs: Any = None) -> Runner:
    """The Runner for config.parallel, compiling `task`'s steps. `state` (host arrays or jax.eval_shape of
    one) gives shapes; `specs` are the params' logical PartitionSpecs (train.loop.state.abstract_init), which
    `sharded` needs."""
    strategy = config.parallel.strategy
    if jax.process_count() > 1 and (strategy == "single" or jax.device_count() == 1):
        raise ConfigError(
            f"parallel.strategy={strategy} runs on one device but {jax.process_count()} processes joined: "
            "use parallel.strategy=sharded or pmap"
        )
    if strategy == "sharded":
        mesh_shape(config.parallel, jax.device_count())  # a mesh that cannot fit fails even on 1 device
    if strategy == "single" or jax.device_count() == 1:
        return Runner(config, state, task, specs)
    if strategy == "pmap":
        return PmapRunner(config, state, task, specs)
    return ShardedRunner(config, state, task, specs)
