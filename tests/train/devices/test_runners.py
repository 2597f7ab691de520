"""Every layout computes the same training run: single, pmap, sharded DP / FSDP / TP on 8 CPU devices.

The reference is one device. Batches carry label -1 padding rows spread unevenly over the shards, so
a wrong reduction (a mean of per-shard means) would show up as a loss and gradient mismatch.
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxblock import Classifier
from train.aot.programs import collectives
from train.config import Config, ConfigError, config_from_dict
from train.devices.hosts import initialize_distributed, is_primary
from train.devices.runners import ShardedRunner, make_runner, mesh_shape
from train.loop.state import TrainState, abstract_init, create_state, init_params

STEPS = 5
BATCH = 16
LENGTH = 16

LAYOUTS: dict[str, dict[str, Any]] = {
    "pmap": {"strategy": "pmap"},
    "dp8": {"strategy": "sharded", "mesh": {"data": 8}},
    "fsdp8": {"strategy": "sharded", "mesh": {"data": 1, "fsdp": 8}},
    "tp2_dp4": {"strategy": "sharded", "mesh": {"data": 4, "tensor": 2}},
}

OPTIMS: dict[str, dict[str, Any]] = {
    # Plain SGD without clipping applies exactly -lr * gradient (lr a power of two), so each step's
    # gradient is read off the real step as (params_before - params_after) / lr; the rounding of
    # params_after (|p| < 4) bounds that reading's error by 4 * 2.4e-7 ~ 1e-6.
    "sgd": {"optimizer": "sgd", "lr": 0.25, "schedule": "constant", "warmup_steps": 0, "clip_norm": None},
    "adamw": {"optimizer": "adamw", "lr": 1e-2, "schedule": "constant", "warmup_steps": 0},
}


def make_config(parallel: dict[str, Any], optim: str = "sgd", **model: Any) -> Config:
    block = {"model_dim": 32, "num_heads": 4, "ffn_dim": 64, **model.pop("block", {})}
    return config_from_dict({
        "model": {"vocab_size": 32, "max_len": LENGTH, "num_layers": 1, "block": block, **model},
        "optim": OPTIMS[optim],
        "train": {"batch_size": BATCH, "steps": STEPS},
        "parallel": parallel,
    })


def host_state(config: Config) -> TrainState:
    model = Classifier(config.model)
    params = init_params(model, seed=0, batch_len=LENGTH)
    return create_state(model, params, config.optim, config.train.steps)


def logical_specs(config: Config) -> Any:
    """The params' logical PartitionSpecs from the one abstract init, as the run module takes them."""
    return abstract_init(Classifier(config.model), LENGTH)[1]


def runner_for(config: Config, state: Any) -> Any:
    return make_runner(config, state, specs=logical_specs(config))


@functools.cache
def initial_state(optim: str) -> TrainState:
    """The shared starting point, as host arrays (built once, compiled: eager init is slow on CPU)."""
    config = make_config({}, optim)
    return host(jax.jit(lambda: host_state(config))())


def make_batch(step: int, rows: int = BATCH) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    lengths = rng.integers(3, LENGTH + 1, rows)
    valid = np.arange(LENGTH)[None, :] < lengths[:, None]
    tokens = np.where(valid, rng.integers(1, 32, (rows, LENGTH)), 0).astype(np.int32)
    labels = rng.integers(0, 2, rows).astype(np.int32)
    labels[[1, 2, 3, 9]] = -1  # padding examples: of 8 shards, shard 0 holds 1 real row, shard 1 none
    return {"tokens": tokens, "valid_tokens": valid, "labels": labels}


def host(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


@functools.cache
def run(layout: str, optim: str) -> dict[str, Any]:
    """STEPS steps from initial_state: per-step losses and params, the runner and the final state."""
    config = make_config(LAYOUTS.get(layout, {"strategy": "single"}), optim)
    runner = runner_for(config, initial_state(optim))
    state = runner.place_state(initial_state(optim))
    losses, params = [], [initial_state(optim).params]
    for step in range(STEPS):
        rng = jax.random.fold_in(jax.random.key(7), step)
        state, metrics = runner.train_step(state, make_batch(step), rng)
        losses.append(float(metrics["loss"]))  # blocks every step: no queue of collectives builds up
        params.append(host(runner.unreplicate(state).params))
    return {"losses": np.array(losses), "params": params, "runner": runner, "state": state}


def max_diff(a: Any, b: Any) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def applied_grads(params: list[Any]) -> list[Any]:
    lr = OPTIMS["sgd"]["lr"]
    return [jax.tree.map(lambda x, y: (x - y) / lr, before, after) for before, after in itertools.pairwise(params)]


@pytest.mark.parametrize(
    "layout",  # pmap (maintenance mode in JAX, 20 s of compile) and the TP layout (below) run with -m slow
    [pytest.param("pmap", marks=pytest.mark.slow), "dp8", "fsdp8", pytest.param("tp2_dp4", marks=pytest.mark.slow)],
)
def test_sgd_losses_grads_and_params_match_single_device(layout: str) -> None:
    ref, got = run("single", "sgd"), run(layout, "sgd")
    assert got["runner"].strategy == LAYOUTS[layout]["strategy"]
    assert np.all(np.isfinite(ref["losses"])) and np.ptp(ref["losses"]) > 1e-2
    np.testing.assert_allclose(got["losses"], ref["losses"], atol=1e-5, rtol=0)
    ref_grads, got_grads = applied_grads(ref["params"]), applied_grads(got["params"])
    for step in range(STEPS):
        assert max_diff(ref_grads[step], jax.tree.map(np.zeros_like, ref_grads[step])) > 1e-3  # real updates
        assert max_diff(got_grads[step], ref_grads[step]) <= 1e-5, f"step {step}"
    assert max_diff(got["params"][-1], ref["params"][-1]) <= 1e-6


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.slow) for name in ("fsdp8", "pmap", "tp2_dp4")]
)
def test_adamw_params_match_single_device(layout: str) -> None:
    """Adam divides each update by sqrt(v), so a gradient made only of rounding noise becomes a step
    of about lr in a direction the reduction order decides. The attention key bias is such a
    parameter: a softmax does not change when one constant is added to all of a query's scores, so
    its gradient is exactly 0 in exact arithmetic and ~1e-9 noise in floats. Its bound is therefore
    STEPS * lr (at most one lr-sized step per update; it cannot change any output). Every other leaf
    has a real gradient and must agree to 1e-5, 1000x below one step's update (lr = 1e-2)."""
    ref, got = run("single", "adamw"), run(layout, "adamw")
    np.testing.assert_allclose(got["losses"], ref["losses"], atol=1e-5, rtol=0)
    lr = OPTIMS["adamw"]["lr"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref["params"][-1]),
                            jax.tree.leaves(got["params"][-1]), strict=True):
        name = jax.tree_util.keystr(path)
        bound = STEPS * lr if name.endswith("['key']['bias']") else 1e-5
        assert float(np.max(np.abs(a - b))) <= bound, name
    assert max_diff(ref["params"][-1], ref["params"][0]) > 1e-2  # the run trained: far above the bound


def test_fsdp_shards_params_and_optimizer_state_as_the_rules_say() -> None:
    got = run("fsdp8", "adamw")
    runner, state = got["runner"], got["state"]
    mesh = runner.mesh
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    params = state.params
    # embed -> fsdp, vocab/heads/mlp -> tensor (size 1), head_dim -> replicated.
    expect = {
        "embedding": PartitionSpec("tensor", "fsdp"),
        "query": PartitionSpec("fsdp", "tensor", None),
        "out": PartitionSpec("tensor", None, "fsdp"),
        "linear1": PartitionSpec("fsdp", "tensor"),
        "linear2": PartitionSpec("tensor", "fsdp"),
    }
    enc = params["encoder"]
    layer = enc["stack"]["layers_0"]
    leaves = {
        "embedding": enc["embedding"], "query": layer["self_attn"]["query"]["kernel"],
        "out": layer["self_attn"]["out"]["kernel"], "linear1": layer["ffn"]["linear1"]["kernel"],
        "linear2": layer["ffn"]["linear2"]["kernel"],
    }
    for name, leaf in leaves.items():
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, expect[name]), leaf.ndim), name
        assert leaf.addressable_shards[0].data.size * 8 == leaf.size, name
    # Adam's moments live where their parameters live; the step counter is replicated.
    adam = state.opt_state.inner_state[1][0]
    for moment in (adam.mu, adam.nu):
        for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(moment), strict=True):
            assert m.sharding.is_equivalent_to(p.sharding, p.ndim)
    assert state.step.sharding.is_fully_replicated
    # Per-device parameter bytes fall by about the device count: every leaf with an `embed` dim is
    # split 8 ways; only the small leaves without one (q/k/v biases [H, K], the 2-class head bias)
    # stay whole, which on this tiny model leaves a ratio of ~7.2.
    arrays = jax.tree.leaves(params)
    total = sum(x.nbytes for x in arrays)
    on_device0 = sum(x.addressable_shards[0].data.nbytes for x in arrays)
    whole = sum(x.nbytes for x in arrays if x.sharding.is_fully_replicated)
    assert on_device0 == whole + (total - whole) // 8
    assert total / on_device0 > 7, total / on_device0


def test_fsdp_step_gathers_the_weights_and_moves_no_activations() -> None:
    """Under FSDP the compiled step gathers every weight where it is used, the embedding table included, and
    reduces their gradients: no all-to-all and no collective-permute, which would mean activations resharded
    (the table's lookup once sent the looked-up rows to their rows' devices, an all-to-all each way)."""
    got = run("fsdp8", "sgd")
    runner, state = got["runner"], got["state"]
    batch = runner.place_batch(make_batch(0))
    for step in (runner._train.lower(state, batch, runner._place_key(jax.random.key(7))),
                 runner._eval.lower(state, batch)):
        counts = collectives(step.compile().as_text())
        assert counts["all-gather"] > 0, counts
        assert counts["all-to-all"] == 0 and counts["collective-permute"] == 0, counts


def test_tensor_parallel_splits_heads_and_ffn_width() -> None:
    got = run("tp2_dp4", "sgd")
    layer = got["state"].params["encoder"]["stack"]["layers_0"]
    q = layer["self_attn"]["query"]["kernel"]  # [D, H, K] = [32, 4, 8]
    assert q.sharding.is_equivalent_to(NamedSharding(got["runner"].mesh, PartitionSpec(None, "tensor")), 3)
    assert q.addressable_shards[0].data.shape == (32, 2, 8)
    w1 = layer["ffn"]["linear1"]["kernel"]  # [D, F] = [32, 64]
    assert w1.addressable_shards[0].data.shape == (32, 32)


def test_undividable_dim_is_replicated_and_named() -> None:
    # 33 tokens cannot split over tensor=2: the vocab dim of the embedding is replicated, not refused.
    config = make_config({"strategy": "sharded", "mesh": {"data": 4, "tensor": 2}}, vocab_size=33)
    runner = runner_for(config, jax.eval_shape(lambda: host_state(config)))
    assert isinstance(runner, ShardedRunner)
    assert runner.replicated_dims == ["['encoder']['embedding'] dim 0 (33) over tensor (2)"]
    spec = runner.state_sharding.params["encoder"]["embedding"].spec
    assert spec == PartitionSpec(None, "fsdp")


def test_sharded_init_equals_host_init_then_place() -> None:
    config = make_config(LAYOUTS["fsdp8"])
    runner = runner_for(config, jax.eval_shape(lambda: host_state(config)))
    direct = runner.init_state(lambda: host_state(config))
    placed = runner.place_state(initial_state("sgd"))
    for a, b in zip(jax.tree.leaves(direct), jax.tree.leaves(placed), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_sharded_dropout_is_layout_invariant() -> None:
    # Partitionable threefry draws each element's bits from its global index, so a sharded run with
    # dropout repeats the single-device run; pmap draws per-device keys and differs by design.
    losses = {}
    for name, parallel in {"single": {"strategy": "single"}, "dp8": LAYOUTS["dp8"]}.items():
        config = make_config(parallel, block={"ffn_dropout": 0.3, "residual_dropout": 0.2})
        state = initial_state("sgd").replace(apply_fn=Classifier(config.model).apply)
        runner = runner_for(config, state)
        _, metrics = runner.train_step(runner.place_state(state), make_batch(0), jax.random.key(3))
        losses[name] = float(metrics["loss"])
    no_dropout = run("single", "sgd")["losses"][0]  # same init, same batch
    assert abs(losses["single"] - no_dropout) > 1e-3  # dropout is really on
    assert abs(losses["dp8"] - losses["single"]) <= 1e-5


def test_eval_pads_rows_that_do_not_split_and_counts_only_real_ones() -> None:
    for layout in ("single", "pmap", "fsdp8"):
        got = run(layout, "sgd")
        batch = make_batch(9, rows=13)  # 13 rows (9 real) over 8 devices: padded with 3 rows labelled -1
        sums = host(got["runner"].eval_step(got["state"], batch))
        assert int(sums["count"]) == int(np.sum(batch["labels"] >= 0)) == 9
        if layout == "single":
            ref = float(sums["loss_sum"])
        assert abs(float(sums["loss_sum"]) - ref) <= 1e-4


def test_layout_errors_are_one_line_and_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="needs 6 devices but 8 are present"):
        mesh_shape(make_config({"mesh": {"data": 3, "tensor": 2}}).parallel, 8)
    assert mesh_shape(make_config({"mesh": {"fsdp": 4}}).parallel, 8) == (2, 4, 1, 1)  # data, fsdp, context, tensor
    bad_batch = make_config({"mesh": {"data": 8}}).model_copy(
        update={"train": make_config({}).train.model_copy(update={"batch_size": 12})}
    )
    with pytest.raises(ConfigError, match=r"train.batch_size=12 .* use a multiple of 8") as err:
        runner_for(bad_batch, jax.eval_shape(lambda: host_state(bad_batch)))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown mesh axes"):
        make_config({"rules": [["embed", "model"]]})


def test_restore_targets_carry_the_layout_unreplicate_gives() -> None:
    for layout in ("single", "pmap", "fsdp8"):
        got = run(layout, "sgd")
        runner = got["runner"]
        plain = runner.unreplicate(got["state"])
        target = runner.abstract_state(jax.eval_shape(lambda: host_state(make_config({}))))
        for x, t in zip(jax.tree.leaves(plain), jax.tree.leaves(target), strict=True):
            assert (x.shape, x.dtype) == (t.shape, t.dtype)
            assert x.sharding.is_equivalent_to(t.sharding, x.ndim), layout
        assert plain.params["head"]["kernel"].shape == (32, 2)  # no device axis, even under pmap


def test_distributed_init_is_a_no_op_for_one_process_and_fails_in_one_line() -> None:
    initialize_distributed(make_config({}).parallel)  # nothing asked: nothing done
    assert jax.process_count() == 1 and is_primary()
    # Too late here (devices are in use), and no cluster to detect: a one-line error naming the fix.
    with pytest.raises(ConfigError, match=r"parallel.coordinator=HOST:PORT") as err:
        initialize_distributed(make_config({"distributed": True}).parallel)
    assert "\n" not in str(err.value)


def test_logical_specs_cover_every_param() -> None:
    config = make_config({}, block={"activation": "swiglu", "num_kv_heads": 2})
    specs = logical_specs(config)
    params = jax.eval_shape(lambda: host_state(config)).params
    spec_tree: Any = jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert spec_tree == jax.tree.structure(params)
    gate = specs["encoder"]["stack"]["layers_0"]["ffn"]["gate"]["kernel"]
    assert gate == PartitionSpec("embed", "mlp")
    with pytest.raises(ValueError, match="logical specs"):  # sharding needs them; nothing re-derives them
        make_runner(make_config(LAYOUTS["fsdp8"]), jax.eval_shape(lambda: host_state(config)))


def _long_run(steps: int, sync_every: int) -> tuple[float, list[float]]:
    config = make_config({"strategy": "sharded", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}}, "adamw")
    config = config.model_copy(update={"train": config.train.model_copy(update={"steps": steps})})
    runner = runner_for(config, jax.eval_shape(lambda: host_state(config)))
    state = runner.init_state(lambda: host_state(config))
    start, losses = time.perf_counter(), []
    metrics: dict[str, Any] = {}
    for step in range(steps):
        state, metrics = runner.train_step(state, make_batch(step % 4), jax.random.key(step))
        if (step + 1) % sync_every == 0:
            losses.append(float(metrics["loss"]))  # block: bound the queue of dispatched collectives
    return time.perf_counter() - start, losses


@pytest.mark.slow
def test_200_step_sharded_run_completes() -> None:
    seconds, losses = _long_run(200, sync_every=8)
    assert len(losses) == 25 and all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0]  # 4 fixed batches: memorised
    print(f"200 sharded steps (2x2x2 mesh) in {seconds:.1f}s")
