"""Faults: non-finite steps (skip vs halt), SIGTERM/SIGINT, kill -9 and a save killed halfway.

The in-process cases inject their fault through the batch source the loop is given (a poisoned batch, a
real signal sent while a batch is prepared); the subprocess cases kill real `python -m train` processes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import Faulty, signal_at
from train import run
from train.checkpoints.restore import restore_run
from train.checkpoints.store import latest_step
from train.loop import trainer as loop
from train.workdir.metrics_log import read_event_records, read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def out_of_vocabulary(batch):
    """A token id past the vocabulary: its embedding lookup is NaN."""
    batch = {**batch, "tokens": batch["tokens"].copy()}
    batch["tokens"][0, 0] = 10_000
    return batch


def poison(step: int):
    return lambda source: Faulty(source, step, out_of_vocabulary)


def same_params(a: Path, b: Path) -> None:
    for x, y in zip(jax.tree.leaves(restore_run(a).params), jax.tree.leaves(restore_run(b).params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def finite(params) -> bool:
    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree.leaves(params))


def test_nan_skip_counts_the_skip_and_keeps_training(tiny, tmp_path):
    summary = run.train(tiny(), tmp_path, batches=poison(3))  # the 4th step
    train = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"}
    assert [train[s]["nonfinite_total"] for s in range(1, 11)] == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert train[4]["loss"] == "nan" and all(np.isfinite(train[s]["loss"]) for s in (3, 5, 10))
    assert summary["steps"] == 10 and np.isfinite(summary["test_loss"])
    assert finite(restore_run(tmp_path).params)


@pytest.mark.slow
def test_nan_halt_names_the_cause_and_keeps_the_newest_checkpoint_finite(tiny, tmp_path):
    with pytest.raises(loop.HaltError) as err:
        run.train(tiny("train.nonfinite=halt", "checkpoint.every=1"), tmp_path, batches=poison(4))  # the 5th step
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("halted at step 5: non-finite loss or gradients (train.nonfinite=halt)")
    assert re.search(r"; first non-finite value in embedding \(layers_0 input, \d+ values\); its input: ", message)
    assert re.search(r"the batch has token ids \d+\.\.10000 outside \[0, 18\): a corrupt batch", message)
    assert "newest checkpoint: 4 (finite)" in message
    assert latest_step(tmp_path) == 4  # step 5 was due a checkpoint (every=1) but is never saved
    assert finite(restore_run(tmp_path).params)


@pytest.mark.slow
def test_huge_learning_rate_halts_naming_a_block_sublayer(reference_run, tiny, tmp_path):
    shutil.copytree(reference_run[0], tmp_path / "run")
    cfg = tiny("train.steps=20", "checkpoint.every=1", "optim.lr=1e30", "optim.warmup_steps=0",
               "optim.schedule=constant")
    with pytest.raises(loop.HaltError) as err:
        run.train(cfg, tmp_path / "run")  # resumes from step 10, then diverges
    message = str(err.value)
    assert re.search(r"first non-finite value in layer \d (norm|attention|FFN|residual add) "
                     r"\((norm1|attn_branch|after_attn|norm2|ffn_branch|after_ffn), \d+ values\); its input: ",
                     message), message
    assert "3 consecutive non-finite steps (train.max_nonfinite)" in message  # default: skip, then halt
    newest = latest_step(tmp_path / "run")
    assert newest is not None and newest >= 10
    assert finite(restore_run(tmp_path / "run").params)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_the_rerun_continues_exactly(reference_run, tiny, tmp_path):
    cfg = tiny("checkpoint.every=100")
    before = signal.getsignal(signal.SIGTERM)
    stopped = run.train(cfg, tmp_path, batches=signal_at(4))
    assert stopped["preempted"] and stopped["step"] == 5
    assert stopped["checkpoint"] == str((tmp_path / "checkpoints/5").absolute())
    assert latest_step(tmp_path) == 5
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone with the run
    rest = run.train(cfg, tmp_path)
    assert rest["session_steps"] == 5 and rest["test_accuracy"] == reference_run[1]["test_accuracy"]
    same_params(reference_run[0], tmp_path)


# A whole resumed run. tests/train/loop/test_trainer.py's lost-tail resume (default suite) resumes past the same
# half-written step-10 save, bitwise equal, with the leftover removed.
@pytest.mark.slow
def test_a_half_written_checkpoint_is_ignored(reference_run, tiny, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    # What a save killed halfway leaves: Orbax's temporary directory, never renamed to its step.
    partial = workdir / "checkpoints/10.orbax-checkpoint-tmp-1234567"
    (workdir / "checkpoints/10").rename(partial)
    shutil.rmtree(partial / "train")
    (partial / "commit_success.txt").unlink(missing_ok=True)
    assert latest_step(workdir) == 5
    assert run.plan_run(tiny(), workdir).start_step == 5
    summary = run.train(tiny(), workdir)
    assert summary["session_steps"] == 5 and latest_step(workdir) == 10
    assert not partial.exists()  # cleaned up once a manager opens the directory for writing
    same_params(reference_run[0], workdir)


# --- real processes ------------------------------------------------------------------------------


def cli(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "train", "--config", str(ROOT / "configs/tiny.yaml"), "--workdir", str(workdir),
            "parallel.strategy=single", "train.progress=false", *args]


def env_one_device() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def tb_steps(workdir: Path) -> list[tuple[str, int]]:
    return sorted((v.tag, ev.step) for path in (workdir / "tb").iterdir()
                  for _, ev in read_event_records(path) for v in ev.summary.value)


@pytest.mark.slow
def test_kill_9_then_resume_is_bitwise_identical(tmp_path):
    args = ("train.steps=40", "checkpoint.every=10", "checkpoint.async_save=false", "train.log_every=1",
            "train.eval_every=10")
    subprocess.run(cli(tmp_path / "whole", *args), env=env_one_device(), check=True, capture_output=True)
    cut = tmp_path / "cut"
    proc = subprocess.Popen(cli(cut, *args), env=env_one_device(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    target = random.Random(0).randint(11, 29)  # a step after the first checkpoint
    wait_for(lambda: any(r["split"] == "train" and r["step"] >= target for r in read_jsonl(cut / "metrics.jsonl")),
             proc)
    proc.kill()
    proc.wait()
    assert latest_step(cut) in (10, 20)
    done = subprocess.run(cli(cut, *args), env=env_one_device(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for x, y in zip(jax.tree.leaves(restore_run(tmp_path / "whole").params),
                    jax.tree.leaves(restore_run(cut).params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    steps = [(r["split"], r["step"]) for r in read_jsonl(cut / "metrics.jsonl")]
    assert steps == [(r["split"], r["step"]) for r in read_jsonl(tmp_path / "whole/metrics.jsonl")]
    assert len(steps) == len(set(steps))
    assert tb_steps(cut) == tb_steps(tmp_path / "whole") and len(set(tb_steps(cut))) == len(tb_steps(cut))


@pytest.mark.slow
def test_kill_9_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path):
    # A wider model makes each save take long enough to be caught in the act.
    args = ("train.steps=30", "checkpoint.every=10", "model.block.model_dim=256", "model.block.ffn_dim=1024",
            "model.num_layers=4", "checkpoint.max_to_keep=5")
    proc = subprocess.Popen(cli(tmp_path, *args), env=env_one_device(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    ckpts = tmp_path / "checkpoints"
    wait_for(lambda: ckpts.is_dir() and any(p.name.startswith("20.orbax-checkpoint-tmp") for p in ckpts.iterdir()),
             proc)
    proc.kill()
    proc.wait()
    assert latest_step(tmp_path) == 10
    done = subprocess.run(cli(tmp_path, *args), env=env_one_device(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resuming from step 10" in done.stderr
    assert latest_step(tmp_path) == 30
    assert not any("orbax-checkpoint-tmp" in p.name for p in ckpts.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_and_exits_0_then_the_rerun_continues(tmp_path, sig):
    args = ("train.steps=400", "checkpoint.every=10", "train.log_every=1")
    proc = subprocess.Popen(cli(tmp_path, *args), env=env_one_device(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: latest_step(tmp_path) is not None, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    stopped = int(re.search(r"stopped by signal at step (\d+): checkpoint saved to (\S+);", out).group(1))
    assert latest_step(tmp_path) == stopped >= 10
    done = subprocess.run(cli(tmp_path, "train.steps=60", "checkpoint.every=10", "train.log_every=1"),
                          env=env_one_device(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"resuming from step {stopped}" in done.stderr
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, 61))
