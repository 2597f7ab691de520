"""The training loop and the pure step it drives: one compile, finite metrics, clipping, deterministic eval,
overfitting a fixed batch, exact resume, the non-finite locator, the periodic actions and the metrics files."""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jaxblock.model import Classifier
from train import run
from train.checkpoints.restore import restore_run
from train.checkpoints.store import latest_step
from train.config import ConfigError
from train.data import labelled as data
from train.data.batches import InMemoryBatches
from train.loop import trainer as loop
from train.loop.state import create_state, init_params
from train.loop.step import loss_fn_for
from train.loop.step import train_step as task_train_step
from train.loop.summary import best_validation
from train.tasks import CLASSIFICATION
from train.workdir.metrics_log import MetricsLog, read_event_records, read_jsonl

train_step = functools.partial(task_train_step, CLASSIFICATION)


@pytest.fixture
def plan(tiny_plan) -> run.Plan:
    return tiny_plan


@pytest.fixture
def reference(reference_run) -> tuple[Path, dict]:
    return reference_run


def loss_and_grads(state, batch, rng):
    """(mean loss, sums, gradients) of the classification loss at state.params."""
    (loss, sums), grads = jax.value_and_grad(loss_fn_for(CLASSIFICATION, state, batch, rng), has_aux=True)(
        state.params)
    return loss, sums, grads


def batch_of(split: data.Split, n: int, length: int) -> dict[str, np.ndarray]:
    rows = split.tokens[:n]
    tokens = np.zeros((n, length), np.int32)  # [N, L]
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    valid = np.arange(length)[None, :] < np.asarray([len(r) for r in rows])[:, None]  # [N, L]
    return {"tokens": tokens, "valid_tokens": valid, "labels": split.labels[:n].astype(np.int32)}


def test_step_compiles_once_across_steps(plan):
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if "backend_compile" in event else None
    )
    state, key = plan.initial_state(), jax.random.key(0)
    for step in range(2):  # the first step compiles the step (and small helpers like fold_in)
        state, _ = plan.runner.train_step(state, plan.batches.batch(step), jax.random.fold_in(key, step))
    before = len(compiles)
    for step in range(2, 7):
        state, metrics = plan.runner.train_step(state, plan.batches.batch(step), jax.random.fold_in(key, step))
    jax.block_until_ready(metrics)
    assert len(compiles) == before, compiles[before:]
    assert int(jax.device_get(state.step)) == 7


def test_metrics_are_finite_and_complete(plan):
    _, metrics = plan.runner.train_step(plan.initial_state(), plan.batches.batch(0), jax.random.key(0))
    m = jax.device_get(metrics)
    assert set(m) >= {"loss", "accuracy", "grad_norm", "lr", "finite", "nonfinite_consecutive", "tokens"}
    for key in ("loss", "accuracy", "grad_norm", "lr"):
        assert np.isfinite(m[key]), key
    assert 0.5 < float(m["loss"]) < 1.5  # ~log 2 for two balanced classes at init
    assert bool(m["finite"]) and int(m["nonfinite_consecutive"]) == 0
    assert int(m["tokens"]) == 32 * 16  # synthetic rows are all full length


@pytest.fixture(scope="module")
def initial_params(tiny_plan) -> dict:
    """The tiny model's seed-0 parameters as host arrays, from one compiled init (an eager init compiles
    every operation on its own)."""
    model = Classifier(tiny_plan.config.model)
    return jax.device_get(jax.jit(lambda: init_params(model, 0, 16))())


def test_clipping_bounds_the_update_norm(plan, tiny, initial_params):
    optim = tiny("optim.optimizer=sgd", "optim.lr=1.0", "optim.schedule=constant", "optim.warmup_steps=0",
                 "optim.clip_norm=0.01").optim
    model = Classifier(plan.config.model)  # the shared plan's model and data; only the optimizer differs
    batch = batch_of(plan.dataset.train, 8, 16)

    @jax.jit  # the state and its step in one program
    def first_step(params, batch, rng):
        return train_step(create_state(model, params, optim, 10), batch, rng)

    new_state, metrics = jax.device_get(first_step(initial_params, batch, jax.random.key(0)))
    delta = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in
                        zip(jax.tree.leaves(new_state.params), jax.tree.leaves(initial_params), strict=True)))
    assert float(metrics["grad_norm"]) > 0.1  # the raw gradient is far above the clip
    assert float(delta) == pytest.approx(0.01, rel=1e-4)  # lr 1 x clipped norm, not the raw one


def test_eval_is_deterministic_and_batch_size_free(plan):
    state = plan.initial_state()
    first = loop.evaluate(CLASSIFICATION, plan.runner, state, plan.batches, "validation")
    again = loop.evaluate(CLASSIFICATION, plan.runner, state, plan.batches, "validation", sync_every=1)
    assert first == again
    assert list(first) == ["loss", "accuracy", "examples"]
    assert first["examples"] == len(plan.dataset.validation) == 100
    other = plan.config.model_copy(update={"train": plan.config.train.model_copy(update={"batch_size": 7})})
    regrouped = loop.evaluate(CLASSIFICATION, plan.runner, state, InMemoryBatches(plan.dataset, other), "validation")
    assert regrouped["accuracy"] == first["accuracy"]
    assert regrouped["loss"] == pytest.approx(first["loss"], rel=1e-5)


@pytest.mark.slow
def test_overfits_four_fixed_examples(plan):
    cfg = plan.config
    assert cfg.model.block.residual_dropout == cfg.model.block.ffn_dropout == cfg.model.embedding.dropout == 0.0
    optim = cfg.optim.model_copy(update={"lr": 3e-3, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0})
    model = Classifier(cfg.model)
    state = create_state(model, init_params(model, 0, 16), optim, 150)
    batch = batch_of(plan.dataset.train, 4, 16)
    step = jax.jit(train_step, donate_argnums=0)
    for i in range(150):
        state, metrics = step(state, batch, jax.random.key(i))
    assert float(metrics["loss"]) < 0.01
    assert float(metrics["accuracy"]) == 1.0


def test_resume_after_a_lost_tail_matches_uninterrupted_bitwise(reference, tiny, tmp_path):
    """A run killed after its step-5 checkpoint, halfway through saving step 10: the step-10 one never
    landed (Orbax's temporary directory is all that is left of it), its logs ran ahead."""
    whole_dir, whole = reference
    cut = tmp_path / "cut"
    shutil.copytree(whole_dir, cut)
    partial = cut / "checkpoints/10.orbax-checkpoint-tmp-1234567"  # never renamed to its step
    (cut / "checkpoints/10").rename(partial)
    shutil.rmtree(partial / "train")
    (partial / "commit_success.txt").unlink(missing_ok=True)
    (cut / "summary.json").unlink()
    assert latest_step(cut) == 5
    assert run.plan_run(tiny(), cut).start_step == 5
    rest = run.train(tiny(), cut)
    assert rest["session_steps"] == 5 and latest_step(cut) == 10
    assert not partial.exists()  # cleaned up once a manager opens the directory for writing
    for x, y in zip(jax.tree.leaves(restore_run(whole_dir).params), jax.tree.leaves(restore_run(cut).params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert whole["test_accuracy"] == rest["test_accuracy"]
    a, b = read_jsonl(whole_dir / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [(r["split"], r["step"]) for r in b] == [(r["split"], r["step"]) for r in a]
    def timeless(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

    assert timeless(b) == timeless(a)  # recomputed steps 6..10 log exactly the same values


def test_halt_report_names_the_block_sublayer_or_the_bad_tokens(plan, initial_params):
    params = jax.tree.map(np.array, initial_params)  # writable copies
    batch = batch_of(plan.dataset.train, 4, 16)
    assert loop.locate_nonfinite(plan.config, params, batch).startswith("none in the forward pass")
    params["encoder"]["stack"]["layers_1"]["ffn"]["linear2"]["kernel"][0, 0] = np.nan
    assert loop.locate_nonfinite(plan.config, params, batch).startswith(
        "first non-finite value in layer 1 FFN (ffn_branch, 64 values); its input: ")
    poisoned = {**batch, "tokens": batch["tokens"].copy()}
    poisoned["tokens"][0, 0] = 99
    assert re.search(r"the batch has token ids \d+\.\.99 outside \[0, 18\): a corrupt batch or the wrong tokenizer$",
                     loop.locate_nonfinite(plan.config, params, poisoned))


def test_periodic_actions_fire_every_n_steps_at_the_end_and_on_a_stop():
    fired: list[tuple[str, int]] = []
    actions = [loop.Every(3, lambda tick: fired.append(("log", tick.done)), on_stop=True),
               loop.Every(4, lambda tick: fired.append(("diag", tick.done)), at_end=False),
               loop.Every(None, lambda tick: fired.append(("never", tick.done)), at_end=False)]
    for done in range(1, 8):
        for action in actions:
            action(loop.Tick(None, done, last=done == 10, stopping=done == 7))
    for action in actions:
        action(loop.Tick(None, 10, last=True, stopping=False))
    assert fired == [("log", 3), ("diag", 4), ("log", 6), ("log", 7), ("log", 10)]


def test_metrics_log_truncates_and_never_duplicates(tmp_path):
    log = MetricsLog(tmp_path, 0)
    for step in range(1, 7):
        log.write("train", step, {"loss": 1.0 / step})
    log.write("val", 5, {"accuracy": 0.5})
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "split": "tra')  # a write torn by a kill
    resumed = MetricsLog(tmp_path, 4)
    for step in range(3, 9):  # steps 3-4 are already there; 5-8 are recomputed
        resumed.write("train", step, {"loss": 2.0})
    resumed.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["split"], r["step"]) for r in records] == [("train", s) for s in range(1, 9)]
    assert [r["loss"] for r in records][2:4] == [1 / 3, 1 / 4]
    tags = [(v.tag, ev.step) for path in sorted((tmp_path / "tb").iterdir())
            for _, ev in read_event_records(path) for v in ev.summary.value]
    assert sorted(tags) == sorted({("train/loss", s) for s in range(1, 9)})


def test_run_writes_config_metadata_curves_and_summary(reference):
    w, summary = reference
    assert {p.name for p in w.iterdir()} >= {"config.yaml", "run.json", "tokenizer", "checkpoints",
                                             "metrics.jsonl", "tb", "curves.png", "summary.json"}
    record = json.loads((w / "run.json").read_text())
    assert record["sessions"][0]["versions"]["jax"] == jax.__version__
    assert record["label_names"] == ["no_match", "match"]
    resolved = yaml.safe_load((w / "config.yaml").read_text())
    assert resolved["model"]["vocab_size"] == 18 and resolved["model"]["num_classes"] == 2  # from the data
    assert json.loads((w / "summary.json").read_text()) == summary
    records = read_jsonl(w / "metrics.jsonl")
    assert [(r["split"], r["step"]) for r in records if r["split"] != "train"] == [
        ("diag", 5), ("val", 5), ("diag", 10), ("val", 10), ("test", 10)]
    diag = next(r for r in records if r["split"] == "diag")
    assert {"residual_ratio/attn/layer_1", "residual_ratio/ffn/layer_0", "grad_norm/input/layer_0",
            "grad_norm/params/layer_1"} <= set(diag)
    assert 0 < diag["residual_ratio/ffn/layer_0"] < 10 and diag["grad_norm/params/layer_1"] > 0
    assert [r["step"] for r in read_jsonl(w / "metrics.jsonl") if r["split"] == "train"] == list(range(1, 11))
    first = next(r for r in records if r["split"] == "train")
    assert list(first) == ["step", "split", "loss", "accuracy", "grad_norm", "lr", "tokens_per_s", "nonfinite_total"]
    assert (w / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(int(p.name) for p in (w / "checkpoints").iterdir()) == [5, 10]
    assert "best validation accuracy" in run.summary_line(summary)
    assert np.isfinite(summary["test_loss"])


def test_packed_batch_gives_the_padded_batch_loss_and_gradients(plan):
    """data.packing: the same examples packed several to a row (segment_ids) give the loss, counts and
    gradients of the padded batch: attention stays inside each example, positions restart, pooling is
    per segment, and the empty slots and rows count nowhere."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 18, n).astype(np.int32) for n in rng.integers(2, 13, 16)]
    labels = rng.integers(0, 2, 16).astype(np.int32)
    padded = {"tokens": np.zeros((16, 16), np.int32), "labels": labels}
    for i, r in enumerate(rows):
        padded["tokens"][i, :len(r)] = r
    padded["valid_tokens"] = np.arange(16)[None, :] < np.asarray([len(r) for r in rows])[:, None]
    packed = data.packed_batch(rows, labels, row_len=16, max_segments=4, batch_size=16)
    assert packed["tokens"].shape[0] in (4, 8) and packed["labels"].shape == (packed["tokens"].shape[0], 4)
    assert int((packed["labels"] >= 0).sum()) == 16

    state = plan.initial_state()
    a_loss, a_sums, a_grads = jax.jit(loss_and_grads)(state, padded, None)
    b_loss, b_sums, b_grads = jax.jit(loss_and_grads)(state, packed, None)
    assert int(a_sums["count"]) == int(b_sums["count"]) == 16
    assert int(a_sums["correct"]) == int(b_sums["correct"])
    np.testing.assert_allclose(float(b_loss), float(a_loss), rtol=1e-5)
    for (path, ga), gb in zip(jax.tree_util.tree_leaves_with_path(a_grads), jax.tree.leaves(b_grads), strict=True):
        np.testing.assert_allclose(gb, ga, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))

    # Without segment_ids the packed rows would mix examples: the loss differs (the test can fail).
    mixed = {k: v for k, v in packed.items() if k != "segment_ids"}
    mixed["labels"] = packed["labels"][:, 0]
    assert abs(float(jax.jit(loss_and_grads)(state, mixed, None)[0]) - float(a_loss)) > 1e-4


PACKING = ("data.packing=true", "data.pack_segments=2", "data.buckets=[16,32]", "model.max_len=32")


def test_packing_source_packs_training_batches_but_not_the_example_batch(plan, tiny):
    batches = InMemoryBatches(plan.dataset, tiny(*PACKING))
    packed = batches.batch(0)
    assert packed["labels"].shape[1] == 2 and packed["tokens"].shape[1] == 32
    assert int((packed["labels"] >= 0).sum()) == 32  # the whole batch of examples, two to a row
    padded = batches.example_batch(0)  # what the diagnostics take: the same examples, one to a row
    assert padded["labels"].shape == (32,) and "segment_ids" not in padded
    assert sorted(padded["labels"].tolist()) == sorted(packed["labels"][packed["labels"] >= 0].tolist())
    assert batches.state() is None


@pytest.mark.slow
def test_packing_run_trains_through_the_loop(tiny, tmp_path):
    summary = run.train(tiny(*PACKING), tmp_path)
    assert summary["steps"] == 10 and np.isfinite(summary["test_accuracy"])


# --- which validation is the best: the task's metrics, ranked as keep-best ranks checkpoints ---------


@pytest.mark.slow
def test_the_summary_names_the_best_validation_by_the_keep_best_metric(tiny, tmp_path):
    """best_metric=val_loss best_mode=min: summary.json's best validation is the one the best checkpoint
    (the one the test ran on) was kept for, not the most accurate one."""
    cfg = tiny("train.steps=8", "train.eval_every=1", "checkpoint.every=1", "checkpoint.keep_best=true",
               "checkpoint.best_metric=val_loss", "checkpoint.best_mode=min", "checkpoint.max_to_keep=1",
               "optim.lr=0.03")
    summary = run.train(cfg, tmp_path)
    vals = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "val"}
    by_loss = min(vals, key=lambda s: (vals[s]["loss"], -s))  # of equally good ones, the newest
    by_accuracy = max(vals, key=lambda s: (vals[s]["accuracy"], s))
    assert by_loss != by_accuracy, f"this run's rankings agree, so it tests nothing: {vals}"
    assert summary["best_val_step"] == by_loss == summary["test_checkpoint_step"]
    assert summary["best_metric"] == "val_loss"
    assert summary["best_val_loss"] == vals[by_loss]["loss"]
    assert summary["best_val_accuracy"] == vals[by_loss]["accuracy"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_best_validation_ranks_by_the_named_metric_in_its_direction_newest_first_on_ties():
    records = [{"split": "val", "step": 2, "loss": 0.5, "accuracy": 0.9},
               {"split": "val", "step": 4, "loss": 0.4, "accuracy": 0.7},
               {"split": "train", "step": 4, "loss": 0.1, "accuracy": 1.0},
               {"split": "val", "step": 6, "loss": 0.4, "accuracy": 0.9}]
    assert best_validation(records, "accuracy", higher=True)["step"] == 6
    assert best_validation(records, "loss", higher=False)["step"] == 6
    assert best_validation(records[:2], "loss", higher=False)["step"] == 4
    assert best_validation(records[:2], "accuracy", higher=True)["step"] == 2
    assert best_validation(records[2:3], "loss", higher=False) is None


def test_the_ranking_defaults_to_the_task_main_metric_and_refuses_other_metrics(tiny):
    from train.tasks import MaskedLMTask, ranking, task_for

    assert ranking(CLASSIFICATION, tiny()) == ("accuracy", True)
    assert ranking(CLASSIFICATION, tiny("checkpoint.best_metric=val_loss")) == ("loss", False)
    loss_up = tiny("checkpoint.best_metric=val_loss", "checkpoint.best_mode=max")
    assert ranking(CLASSIFICATION, loss_up) == ("loss", True)
    assert ranking(MaskedLMTask(), tiny()) == ("masked_accuracy", True)
    with pytest.raises(ConfigError, match=r"best_metric=val_f1 is not a metric of task=classification: set it to "
                                          r"one of val_loss, val_accuracy$"):
        task_for(tiny("checkpoint.best_metric=val_f1"))
    with pytest.raises(ConfigError, match=r"task=ranking is not a task: set task to one of classification, mlm"):
        task_for(tiny("task=ranking"))
