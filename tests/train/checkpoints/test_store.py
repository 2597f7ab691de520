"""Orbax checkpoints: exact round trip, keep-best, compatibility errors, inference loading, and restore
onto a different device count / mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train import run
from train.checkpoints.restore import restore_run
from train.checkpoints.store import (
    CheckpointError,
    Checkpoints,
    check_compatible,
    latest_step,
    read_run_config,
)

ROOT = Path(__file__).resolve().parents[3]


def leaves_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def trained_plan(tiny_plan):
    """The shared tiny plan and its state after `steps` training steps."""

    def train(steps: int = 3):
        state, key = tiny_plan.initial_state(), jax.random.key(0)
        for step in range(steps):
            state, _ = tiny_plan.runner.train_step(state, tiny_plan.batches.batch(step), jax.random.fold_in(key, step))
        return tiny_plan, state

    return train


def test_round_trip_is_exact_and_holds_step_seed_labels_and_data_state(trained_plan, tmp_path):
    plan, state = trained_plan()
    ckpts = Checkpoints(tmp_path, plan.config.checkpoint)
    data_state = {"position": 7, "shard": [1, 2]}  # what a streaming source would save
    assert ckpts.save(state, {"seed": 0, "label_names": ["no_match", "match"], "data_state": data_state})
    ckpts.wait()
    restored, meta = ckpts.restore(3, state)
    ckpts.close()
    assert meta == {"seed": 0, "label_names": ["no_match", "match"], "data_state": data_state, "step": 3}
    assert int(restored.step) == 3
    leaves_equal(restored.params, state.params)
    leaves_equal(restored.opt_state, state.opt_state)  # Adam moments and the non-finite counters
    assert type(restored.opt_state) is type(state.opt_state)


def test_the_loop_saves_the_batch_source_state_with_each_checkpoint(reference_run):
    workdir, _ = reference_run
    ckpts = Checkpoints(workdir, read_run_config(workdir).checkpoint)
    try:
        for step in (5, 10):
            _, meta = ckpts.restore(step, ckpts_target(workdir))
            assert meta["step"] == step and meta["seed"] == 0 and meta["data_state"] is None  # in-memory source
    finally:
        ckpts.close()


def ckpts_target(workdir: Path):
    from train.loop.state import create_state, init_params
    from train.tasks import CLASSIFICATION

    config = read_run_config(workdir)
    model = CLASSIFICATION.build_model(config.model)
    return jax.eval_shape(lambda: create_state(model, init_params(model, 0, 16), config.optim, config.train.steps))


@pytest.mark.slow
def test_keep_best_keeps_the_best_and_the_newest(tiny, tmp_path):
    cfg = tiny("train.eval_every=2", "checkpoint.every=2", "checkpoint.keep_best=true", "checkpoint.max_to_keep=1")
    summary = run.train(cfg, tmp_path)
    vals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["accuracy"] for r in vals if r["split"] == "val"}
    assert sorted(by_step) == [2, 4, 6, 8, 10]
    best = max(by_step, key=lambda s: (by_step[s], s))  # of equally good ones, the newest
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == sorted({best, 10})
    assert summary["test_checkpoint_step"] == best
    from train.inference import TrainedRun

    assert TrainedRun.load(tmp_path).step == best  # evaluate/predict default to the best, not the newest
    assert restore_run(tmp_path).config.checkpoint.keep_best


def test_shape_mismatch_names_the_parameter(trained_plan, tiny, tmp_path):
    plan, state = trained_plan(steps=1)
    ckpts = Checkpoints(tmp_path, plan.config.checkpoint)
    ckpts.save(state, {"seed": 0, "label_names": []})
    ckpts.close()
    other = run.plan_run(tiny("model.block.ffn_dim=48"), tmp_path / "elsewhere")
    with pytest.raises(CheckpointError) as err:
        check_compatible(tmp_path, 1, other.abstract.params)
    message = str(err.value)
    assert "parameter encoder/stack/layers_0/ffn/linear1/bias has shape (64,) in the checkpoint but (48,)" in message
    deeper = run.plan_run(tiny("model.num_layers=3"), tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match=r"lacks parameter encoder/stack/layers_2/\S+ that the config has"):
        check_compatible(tmp_path, 1, deeper.abstract.params)


def test_restore_run_without_a_checkpoint_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"holds no run \(config.yaml missing\)"):
        restore_run(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        restore_run(tmp_path / "missing")


def test_restore_onto_a_different_mesh(trained_plan, tmp_path):
    """Saved with parameters sharded over 8 devices; restored onto one device and onto a 2x4 mesh."""
    plan, state = trained_plan(steps=1)
    devices = np.asarray(jax.devices()[:8])
    mesh8 = Mesh(devices, ("data",))

    def shard_rows(x, mesh, axis):
        spec = PartitionSpec(axis) if x.ndim and x.shape[0] % mesh.shape[axis] == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    sharded = state.replace(params=jax.tree.map(lambda x: shard_rows(x, mesh8, "data"), state.params))
    assert len(sharded.params["encoder"]["embedding"].sharding.device_set) == 8
    ckpts = Checkpoints(tmp_path, plan.config.checkpoint)
    ckpts.save(sharded, {"seed": 0, "label_names": []})
    ckpts.wait()
    one, _ = ckpts.restore(1, state)  # the single-device target (only its shapes and shardings are used)
    assert one.params["encoder"]["embedding"].sharding.device_set == {jax.devices()[0]}
    leaves_equal(one.params, state.params)
    mesh24 = Mesh(devices.reshape(2, 4), ("data", "model"))
    target = state.replace(params=jax.tree.map(lambda x: shard_rows(x, mesh24, "model"), state.params))
    other, _ = ckpts.restore(1, target)
    ckpts.close()
    assert other.params["encoder"]["embedding"].sharding == target.params["encoder"]["embedding"].sharding
    leaves_equal(other.params, state.params)


def _run(workdir: Path, devices: int, steps: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, "-m", "train", "--config", str(ROOT / "configs/tiny.yaml"), "--workdir", str(workdir),
            f"train.steps={steps}", "checkpoint.every=4", "train.eval_every=4", "train.progress=false",
            # SGD: Adam's normalisation would magnify the last-bit differences of sharded reductions;
            # a constant rate: stopping at 4 and 8 of 12 must not change the schedule.
            "optim.optimizer=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0"]
    if devices > 1:  # FSDP: parameters and optimizer state really are split over the devices
        args += ["parallel.strategy=sharded", "parallel.mesh.data=1", "parallel.mesh.fsdp=-1"]
    return subprocess.run(args, env=env, capture_output=True, text=True)


@pytest.mark.slow
def test_cli_restores_across_device_counts_8_1_8(tmp_path):
    """The same run continued on 8 (FSDP), then 1, then 8 devices equals one run on 1 device (up to the
    order of floating-point reductions across devices)."""
    for steps, devices in ((4, 8), (8, 1), (12, 8)):
        done = _run(tmp_path / "moved", devices, steps)
        assert done.returncode == 0, done.stderr
        assert latest_step(tmp_path / "moved") == steps
    done = _run(tmp_path / "still", 1, 12)
    assert done.returncode == 0, done.stderr
    moved, still = restore_run(tmp_path / "moved").params, restore_run(tmp_path / "still").params
    for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(still), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
