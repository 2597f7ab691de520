"""The train and eval steps for a mesh, built in one place: the sharded runner, `lower`, `compile` and the
benchmarks all get their programs here.

`mesh_steps(task, mesh, rules, ...)` wraps train/loop/step.py's pure steps for a mesh of any devices (this
host's, a chip's compile-only devices from its topology, or an abstract mesh for `jax.export`):

- while the step is traced, the mesh (as an abstract mesh), the logical-axis rules and the context
  strategy are ambient, so the per-shard attention kernels (jaxblock/attention/platform.py `mesh_layout`)
  and the model's logical activation constraints read the layout; `platform`, when given, is the platform
  the attention kernels are chosen for (`for_platform`: tracing on a CPU host for a TPU, say);
- the new state is pinned to the state's shardings and the metrics are replicated, inside the program
  (by constraint, not jit's out_shardings, so a state rebuilt with new optimizer closures of the same
  shapes runs the same program);
- the train step donates the state;
- on a TPU, a mesh with an fsdp axis compiles with XLA's windowed einsum off (`compiler_options`): the TPU
  compiler would otherwise turn each matmul of an FSDP-sharded weight into a loop that passes blocks of the
  activations around the chips (collective-permutes) instead of gathering the weight, and hold more memory
  for it (BERT-base, L 512, 32 rows a chip on v5e-8: a peak of 7.60 GiB with it, 6.52 GiB without, below data
  parallel's 6.90; `python -m train compile --layout fsdp` shows the collectives).

Each call builds new functions: jit caches traces by function, and neither the target platform nor the
ambient context is part of that cache's key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxblock.attention.context import context_strategy
from jaxblock.attention.platform import for_platform
from train.loop.step import eval_step, train_step
from train.tasks import Task

# XLA TPU's collective matmul for all-gathers and reduce-scatters (libtpu flags).
NO_WINDOWED_EINSUM = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
}


class MeshSteps(NamedTuple):
    train: Any  # jitted (state, batch, rng) -> (state, metrics); the state is donated
    eval: Any  # jitted (state, batch) -> the task's sums


def kernel_context(mesh: Any, rules: Any, strategy: str, platform: str | None = None) -> contextlib.ExitStack:
    """What is ambient while a step is traced for `mesh`: its abstract mesh, the logical-axis rules, the
    context strategy and (when given) the platform the kernels are chosen for."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)))
    stack.enter_context(nn.logical_axis_rules(rules))
    stack.enter_context(context_strategy(strategy))
    if platform is not None:
        stack.enter_context(for_platform(platform))
    return stack


def compiler_options(mesh: Any, platform: str | None = None) -> dict[str, Any]:
    """The compiler options of a step for `mesh` on `platform` (this host's backend when None)."""
    platform = platform or jax.default_backend()
    if platform == "tpu" and dict(mesh.shape).get("fsdp", 1) > 1:
        return dict(NO_WINDOWED_EINSUM)
    return {}


def mesh_steps(task: Task, mesh: Any, rules: Any, strategy: str, state_shardings: Sequence[NamedSharding],
               platform: str | None = None) -> MeshSteps:
    """The task's train and eval steps for `mesh`; `state_shardings` are the state's leaves' shardings, in
    flattening order (train/devices/mesh.py `state_shardings`)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    flat = list(state_shardings)

    def pin(state: Any) -> Any:
        treedef: Any = jax.tree.structure(state)
        return jax.lax.with_sharding_constraint(state, jax.tree.unflatten(treedef, flat))

    def train(state: Any, batch: Any, rng: jax.Array) -> tuple[Any, Any]:
        with kernel_context(mesh, rules, strategy, platform):
            new_state, metrics = train_step(task, state, batch, rng)
        return pin(new_state), jax.lax.with_sharding_constraint(metrics, replicated)

    def evaluate(state: Any, batch: Any) -> Any:
        with kernel_context(mesh, rules, strategy, platform):
            return jax.lax.with_sharding_constraint(eval_step(task, state, batch), replicated)

    options = compiler_options(mesh, platform)
    return MeshSteps(jax.jit(train, donate_argnums=0, compiler_options=options),
                     jax.jit(evaluate, compiler_options=options))
