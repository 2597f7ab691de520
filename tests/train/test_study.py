"""train.study: the Pre-LN vs Post-LN study. Its parts (data, step, verdicts, schedules, usage) by default;
a tiny study and the full one are `slow`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from jaxblock.model import Classifier, unstack_layer_params
from train import study
from train.tasks import CLASSIFICATION

# The shapes of tests/jaxblock/test_diagnostics.py (configs/tiny.yaml's): eager op compilations are shared.
TINY = ["--depths", "2", "--width", "32", "--ffn-dim", "64", "--heads", "2", "--steps", "6", "--warmup", "2",
        "--batch-size", "4", "--examples", "64", "--grad-seeds", "0", "--seeds", "0"]


@pytest.mark.slow
def test_tiny_study_writes_tables_figures_and_the_init_gradients(tmp_path: Path, capsys: Any) -> None:
    assert study.main([*TINY, "--out", str(tmp_path)]) == 0
    assert "study-ln: done in" in capsys.readouterr().out
    result = json.loads((tmp_path / "study_ln.json").read_text())
    table = (tmp_path / "study_ln.md").read_text()
    runs = result["runs"]
    assert [(r["placement"], r["warmup"]) for r in runs] == [("pre", 2), ("pre", 0), ("post", 2), ("post", 0)]
    for r in runs:
        assert len(r["losses"]) == 6 and r["verdict"] in ("converged", "learning", "stalled", "diverged")
        assert r["final_loss"] == pytest.approx(r["losses"][-1])  # the last 10% of 6 steps is the last one
        assert (f"| 2 | {r['placement']}-LN | {r['warmup']} | {r['verdict']} (all 1) | {r['final_loss']:.3f} | "
                f"{r['val_accuracy']:.3f} |") in table
    for png in ("study_grad_norms.png", "study_loss_curves.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # (a) equals the gradient of each layer's ffn/linear2/kernel computed directly.
    s = study.Settings(depths=(2,), width=32, ffn_dim=64, heads=2, steps=6, warmup=2, batch_size=4, examples=64,
                       grad_seeds=(0,))
    train_split, _ = study.count_task(s)
    batch = study._batch(train_split, s, s.data_seed, 0)
    for placement in study.PLACEMENTS:
        config = study.model_config(s, 2, placement, s.vocab + 1)
        params = study.initializer(Classifier(config), s)(0)
        assert params["encoder"]["stack"]["layers"]["ffn"]["linear2"]["kernel"].shape == (2, 64, 32)  # [B, F, D]
        unrolled = Classifier(config.model_copy(update={"scan_layers": False}))

        def loss(p: Any, model: Classifier = unrolled) -> Any:
            logits: Any = model.apply({"params": p}, batch["tokens"], batch["valid_tokens"])
            return CLASSIFICATION.loss(logits, batch)

        grads = jax.grad(loss)(unstack_layer_params(params))["encoder"]["stack"]
        expected = [np.linalg.norm(grads[f"layers_{i}"]["ffn"]["linear2"]["kernel"]) for i in range(2)]
        np.testing.assert_allclose(result["grad_norms"][f"{placement}/2"], expected, rtol=1e-5)


def test_count_task_labels_are_the_counts_and_balanced() -> None:
    s = study.Settings(examples=400)
    train_split, val_split = study.count_task(s)
    assert len(train_split) + len(val_split) == 400 and len(val_split) == 40
    for split in (train_split, val_split):
        symbols = [row - 1 for row in split.tokens]  # token id = symbol + 1
        expected = [int(np.sum(r == 0) > np.sum(r == 1)) for r in symbols]
        assert split.labels.tolist() == expected
        assert all(s.length // 2 <= len(r) <= s.length and r.min() >= 1 for r in split.tokens)
    assert np.sum(train_split.labels) + np.sum(val_split.labels) == 200


@pytest.mark.slow  # 7 s; the study data, verdicts and schedules stay in the default suite
def test_step_is_adam_scaled_by_the_lr_argument() -> None:
    """The study's step (the trainer's gradient_step) applies params - lr * Adam(b1 0.9, b2 0.98) direction;
    one compiled step serves every learning rate."""
    s = study.Settings(depths=(1,), width=32, ffn_dim=64, heads=2, batch_size=4, examples=64)
    model = Classifier(study.model_config(s, 1, "pre", s.vocab + 1))
    params = study.initializer(model, s)(0)
    batch = study._batch(study.count_task(s)[0], s, s.data_seed, 0)

    def loss(p: Any) -> Any:
        logits: Any = model.apply({"params": p}, batch["tokens"], batch["valid_tokens"], train=True)
        return CLASSIFICATION.loss(logits, batch)

    expected_loss, grads = jax.value_and_grad(loss)(params)
    direction, _ = study._ADAM.update(grads, study._ADAM.init(params), params)
    step = study._make_step(model)
    for lr in (1e-3, 0.5):
        new_state, got_loss = step(study.initial_state(params), batch, np.float32(lr))
        assert float(got_loss) == pytest.approx(float(expected_loss), rel=1e-6)
        leaves = zip(jax.tree.leaves(new_state.params), jax.tree.leaves(params), jax.tree.leaves(direction),
                     jax.tree.leaves(grads), strict=True)
        for got, p, d, g in leaves:
            # Adam's first step is g / (|g| + eps): where |g| is near eps, last-bit differences between
            # this eager gradient and the compiled one are magnified, so compare where the gradient is clear.
            clear = np.abs(np.asarray(g)) > 1e-5
            np.testing.assert_allclose(np.asarray(got)[clear], np.asarray(p - lr * d)[clear], rtol=1e-4, atol=1e-7)
    assert step._cache_size() == 1


def test_verdicts() -> None:
    chance = math.log(2)
    flat = [chance] * 40
    assert study.verdict([0.7, float("nan")], float("nan"), 2) == "diverged"
    assert study.verdict(flat[:30] + [3.0] * 10, 0.5, 2) == "diverged"
    assert study.verdict([0.9] * 10 + [0.05] * 20 + flat, 0.5, 2) == "diverged"  # learned, then lost it
    assert study.verdict(flat, 0.52, 2) == "stalled"
    assert study.verdict(flat + [0.4] * 20, 0.8, 2) == "learning"
    assert study.verdict(flat + [0.01] * 20, 1.0, 2) == "converged"


def test_schedules_share_the_peak_and_differ_only_in_warmup() -> None:
    s = study.Settings(steps=10, warmup=4, lr=1e-2)
    warm, cold = study.schedule(s, True), study.schedule(s, False)
    assert float(warm(0)) == 0.0 and float(warm(4)) == pytest.approx(1e-2)
    assert float(cold(0)) == pytest.approx(1e-2)
    assert float(warm(9)) < 1e-2 and float(cold(9)) < 1e-2


@pytest.mark.parametrize("argv, message", [
    (["--width", "30", "--heads", "4"], "not divisible"),
    (["--steps", "10", "--warmup", "10"], "warmup < steps"),
    (["--depths"], "expected at least one argument"),
])
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    assert study.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_full_study_reproduces_the_post_ln_trend(tmp_path: Path) -> None:
    """The study in docs/diagnostics.md: relative to Pre-LN, Post-LN's FFN-output gradients grow toward the
    output layers."""
    assert study.main(["--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "study_ln.json").read_text())
    for depth in result["settings"]["depths"]:
        pre, post = result["grad_norms"][f"pre/{depth}"], result["grad_norms"][f"post/{depth}"]
        assert post[-1] / pre[-1] > post[0] / pre[0]
    pre_warm = [r["verdict"] for r in result["runs"] if r["placement"] == "pre" and r["warmup"]]
    assert pre_warm == ["converged"] * len(pre_warm)
