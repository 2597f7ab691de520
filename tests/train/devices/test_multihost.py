"""Multi-host: 2 processes on 127.0.0.1 joined by jax.distributed (4 CPU devices each) compute what 1
process with 8 devices computes, and the checkpoint they write together restores in 1 process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from tests.conftest import PROCESS_TIMEOUT, free_port, run_processes
from tests.train.devices import multihost_driver as driver
from train.checkpoints.store import Checkpoints

ROOT = Path(__file__).resolve().parents[3]
DRIVER = Path(driver.__file__).resolve()


def child_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return env


@pytest.mark.slow
def test_two_processes_match_one_process_and_their_checkpoint_restores_in_one(tmp_path: Path) -> None:
    port = free_port()
    commands = [[sys.executable, str(DRIVER), "--port", str(port), "--num-processes", "2", "--process-id", str(i),
                 "--devices", "4", "--out", str(tmp_path)] for i in range(2)]
    run_processes(commands, child_env(4), ROOT)
    two = json.loads((tmp_path / "result.json").read_text())
    assert two["processes"] == 2 and two["devices"] == 8 and two["share"] == [0, 2]

    one = driver.run({}, None)  # this process: 8 devices, the same mesh (data 4 x fsdp 2)
    assert one["processes"] == 1 and one["devices"] == 8
    # The same program on the same 8 devices: only the all-reduce transport differs (gloo across
    # processes), so the curves agree to float32 rounding, far below the step-to-step change.
    np.testing.assert_allclose(two["losses"], one["losses"], atol=1e-5, rtol=0)
    assert np.ptp(one["losses"]) > 1e-2

    # The checkpoint both processes wrote (each its own shards) restores straight into this process's
    # mesh: the target is abstract (shapes + shardings), so no state is built first.
    runner, config = one["runner"], one["config"]
    ckpts = Checkpoints(tmp_path, config.checkpoint)
    assert ckpts.latest_step() == driver.STEPS
    restored, meta = ckpts.restore(driver.STEPS, runner.abstract_state(jax.eval_shape(one["make_state"])))
    ckpts.close()
    assert meta["label_names"] == ["even", "odd"]
    state: Any = runner.place_state(restored)
    assert int(state.step) == driver.STEPS
    sums = runner.eval_step(state, one["share_of"](100))
    assert abs(float(sums["loss_sum"]) / float(sums["count"]) - two["eval_loss"]) <= 1e-6
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one["state"].params), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def train_losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.mark.slow
def test_cli_two_processes_train_like_one_and_one_process_resumes_and_evaluates(tmp_path: Path) -> None:
    """The real command: tiny config, FSDP 2 x data 4. One process with 8 devices trains 10 steps
    straight; two processes with 4 devices each train 8, then one process resumes their run to 10 and
    evaluates its checkpoint on one device. A constant learning rate keeps the resumed schedule equal."""
    one, two = tmp_path / "one", tmp_path / "two"

    def train(workdir: Path, *overrides: str) -> list[str]:
        return [sys.executable, "-m", "train", "--config", "configs/tiny.yaml", "--workdir", str(workdir),
                "train.progress=false", "train.log_every=1", "train.eval_every=100", "checkpoint.every=4",
                "optim.schedule=constant", "optim.warmup_steps=0", "parallel.mesh.fsdp=2", *overrides]

    run_processes([train(one, "train.steps=10")], child_env(8), ROOT)
    port = free_port()
    first, second = run_processes([train(two, "train.steps=8", f"parallel.coordinator=127.0.0.1:{port}",
                                         "parallel.num_processes=2", f"parallel.process_id={i}") for i in range(2)],
                                  child_env(4), ROOT)
    assert sorted(train_losses(two)) == list(range(1, 9))
    # Process 0 speaks for the run; process 1 prints none of the run's lines.
    assert "step 8: validation accuracy" in first and "test accuracy" in first
    assert "validation accuracy" not in second and "test accuracy" not in second and "steps in" not in second
    single = ["parallel.coordinator=null", "parallel.num_processes=null", "parallel.process_id=null"]
    run_processes([train(two, "train.steps=10", *single)], child_env(8), ROOT)
    want, got = train_losses(one), train_losses(two)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    np.testing.assert_allclose([got[s] for s in range(1, 11)], [want[s] for s in range(1, 11)], atol=1e-5, rtol=0)

    # Restore the multi-host run's checkpoint on a single device of a single process.
    (out,) = run_processes([[sys.executable, "-m", "train", "evaluate", "--workdir", str(two), "--split", "test"]],
                           child_env(1), ROOT)
    line = next(x for x in out.splitlines() if x.startswith("test:"))
    records = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    test = next(r for r in records if r["split"] == "test" and r["step"] == 10)
    assert abs(float(line.split("loss ")[1].split()[0]) - test["loss"]) <= 1e-4  # printed to 4 decimals


@pytest.mark.slow
def test_two_process_fsdp_halt_names_the_sublayer_and_saves_nothing_non_finite(tmp_path: Path) -> None:
    """train.nonfinite=halt with parameters sharded across both processes: the locator gathers them from
    every process, process 0 names the block/sublayer, both exit 1, and no checkpoint holds the bad state."""
    port = free_port()
    cmd = [sys.executable, "-m", "train", "--config", "configs/tiny.yaml", "--workdir", str(tmp_path),
           "train.progress=false", "train.steps=6", "checkpoint.every=2", "train.eval_every=100",
           "parallel.mesh.fsdp=2", "train.nonfinite=halt", "optim.lr=1e30", "optim.schedule=constant",
           "optim.warmup_steps=0", f"parallel.coordinator=127.0.0.1:{port}",
           "parallel.num_processes=2"]
    env = child_env(4)
    procs = [subprocess.Popen([*cmd, f"parallel.process_id={i}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=PROCESS_TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "non-finite" in outs[0] and "layer" in outs[0], outs[0]
    ckpt_dir = tmp_path / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []
    assert steps in ([], [2], [2, 4]), steps  # whatever was saved came before the first non-finite step


CLI_ARGS = ("train.progress=false", "train.log_every=1", "train.eval_every=100", "checkpoint.every=4",
            "checkpoint.max_to_keep=10", "optim.schedule=constant", "optim.warmup_steps=0", "parallel.mesh.fsdp=2")
NOISE = ("Traceback", "Exception ignored", "Event loop is closed", "leaked shared_memory", "ERROR:absl")


def together(port: int, processes: int) -> list[list[str]]:
    """The overrides that make each of `processes` processes join one run (none for a single process)."""
    if processes == 1:
        return [["parallel.coordinator=null", "parallel.num_processes=null", "parallel.process_id=null"]]
    return [[f"parallel.coordinator=127.0.0.1:{port}", f"parallel.num_processes={processes}",
             f"parallel.process_id={i}"] for i in range(processes)]


def session(config: str, workdir: Path, steps: int, processes: int, devices: int, *extra: str) -> list[str]:
    """One session of a run on `processes` x `devices`; every process's whole output, checked for noise."""
    base = [sys.executable, "-m", "train", "--config", config, "--workdir", str(workdir), *CLI_ARGS,
            f"train.steps={steps}", *extra]
    outputs = run_processes([base + own for own in together(free_port(), processes)], child_env(devices), ROOT)
    for out in outputs:
        assert not any(noise in out for noise in NOISE), out[-3000:]
    return outputs


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps: int) -> None:
    """Each step logged once, with the loss of the uninterrupted run: the same global batches, so every
    example was read exactly as often as in the uninterrupted run."""
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], atol=2e-5, rtol=0)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_moved_once_and_every_process_resumes_from_the_same_step(tmp_path: Path):
    """1 process x 8 devices trains 8 steps; its newest checkpoint is damaged; 2 processes x 4 devices
    resume (in-memory data, so also 1 -> 2 processes): both detect the damage, process 0 moves it aside
    once while process 1 waits, and both continue from step 4 to the losses of an uninterrupted run."""
    from tests.faults.stress import damage

    one, two = tmp_path / "one", tmp_path / "two"
    session("configs/tiny.yaml", one, 12, 1, 8)
    session("configs/tiny.yaml", two, 8, 1, 8)
    damage(two / "checkpoints" / "8", "truncate_array_file")
    first, second = session("configs/tiny.yaml", two, 12, 2, 4)
    notes = [line for line in first.splitlines() if "is damaged" in line]
    assert len(notes) == 1 and notes[0].startswith("checkpoint 8 is damaged (params/"), first
    assert "moved to checkpoints.damaged/8-" in notes[0] and notes[0].endswith("resuming from 4")
    assert "resuming from step 4" in first and "is damaged" not in second and "resuming" not in second
    assert [p.name.split("-")[0] for p in (two / "checkpoints.damaged").iterdir()] == ["8"]
    assert_losses_match(train_losses(two), train_losses(one), 12)


@pytest.mark.slow
def test_a_streamed_run_resumes_on_another_process_count_reading_each_example_once(tmp_path: Path):
    """Masked-LM pretraining streamed from a corpus: 2 processes x 4 devices train 4 steps, 1 process x 4
    devices continues to 8, 2 processes x 2 devices to 12: every step logs the loss of 1 process x 8
    devices reading the stream straight through (the same global batches, so each example once)."""
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    config = "configs/pretrain_tiny.yaml"
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    session(config, straight, 12, 1, 8, cache, "checkpoint.async_save=false")
    for steps, processes, devices in ((4, 2, 4), (8, 1, 4), (12, 2, 2)):
        session(config, elastic, steps, processes, devices, cache, "checkpoint.async_save=false")
    assert_losses_match(train_losses(elastic), train_losses(straight), 12)
