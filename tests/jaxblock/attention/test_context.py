"""Context parallelism: the sequence split over a 'context' mesh axis computes what one device computes.

Fast: the kernel (both strategies, every mask at once, GQA) against the dense kernel on a data x context x
tensor mesh; a few training steps through the sharded runner with a length that does not divide; the
dispatch rule; the one-line refusals. Slow: the whole equality grid (bench/context_parallel.py: strategy x
C = 2, 4, 8 x mask kind) and the CLI trained with context=4 then resumed with context=2.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from bench import context_parallel as bench_cp
from jaxblock import Classifier, masks
from jaxblock.attention import choose_implementation
from jaxblock.attention.context import context_attention, context_strategy
from jaxblock.attention.dense import dense_attention
from train.config import DEFAULT_RULES, MESH_AXES, ConfigError, config_from_dict
from train.devices.runners import make_runner
from train.loop.state import abstract_init, create_state, init_params

ROOT = Path(__file__).resolve().parents[3]
N, L, H, G, K = 4, 16, 4, 2, 8


def mesh(data: int, context: int, tensor: int) -> Any:
    return jax.make_mesh((data, 1, context, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def masked_inputs(seed: int = 0) -> dict[str, Any]:
    """q, k, v (GQA 4:2), padded and packed rows (one row with no token: its queries see no key), a per-example
    attn_mask, causal and a window: every mask kind at once."""
    r = np.random.default_rng(seed)
    lengths = np.array([16, 11, 0, 5])
    seg = np.full((N, L), -1, np.int32)
    seg[0] = np.repeat([0, 1, 2], [5, 6, 5])
    seg[1, :11] = np.repeat([0, 1], [4, 7])
    seg[3, :5] = 0
    return {
        "q": jnp.asarray(r.normal(size=(N, L, H, K)), jnp.float32),
        "k": jnp.asarray(r.normal(size=(N, L, G, K)), jnp.float32),
        "v": jnp.asarray(r.normal(size=(N, L, G, K)), jnp.float32),
        "valid": masks.lengths_to_valid_tokens(jnp.asarray(lengths), L),
        "seg": jnp.asarray(seg),
        "attn": jnp.asarray(r.random((N, L, L)) > 0.2),
        "window": jnp.int32(5),
        "cot": jnp.asarray(r.normal(size=(N, L, H, K)), jnp.float32),
    }


def dense_reference(x: dict[str, Any], causal: bool) -> Any:
    def f(q: Any, k: Any, v: Any) -> Any:
        mask = masks.attention_mask(x["valid"], causal=causal, attn_mask=x["attn"], segment_ids=x["seg"],
                                    window=x["window"])
        seen = masks.sees_a_key(mask, x["valid"], causal=causal, plain=False)
        return dense_attention(q, k, v, mask, seen)

    return f


def context_version(x: dict[str, Any], causal: bool, strategy: str, chunk: int) -> Any:
    def f(q: Any, k: Any, v: Any) -> Any:
        with nn.logical_axis_rules(DEFAULT_RULES), context_strategy(strategy):
            return context_attention(q, k, v, x["valid"], causal=causal, attn_mask=x["attn"], segment_ids=x["seg"],
                                     chunk_size=chunk, window=x["window"])

    return f


def value_and_grads(f: Any, x: dict[str, Any]) -> tuple[Any, Any]:
    out, vjp = jax.vjp(f, x["q"], x["k"], x["v"])
    return out, vjp(x["cot"])


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_kernel_equals_dense_attention_for_every_mask_at_once(strategy: str) -> None:
    """data 2 x context 2 x tensor 2; key blocks of 4 inside each shard of 8, so the online softmax runs over
    several blocks per device (and per ring hop); a row without tokens gets exactly 0 with finite gradients."""
    x = masked_inputs()
    want_out, want_grads = jax.jit(lambda: value_and_grads(dense_reference(x, True), x))()
    with jax.set_mesh(mesh(2, 2, 2)):
        got_out, got_grads = jax.jit(lambda: value_and_grads(context_version(x, True, strategy, 4), x))()
    assert float(jnp.max(jnp.abs(got_out - want_out))) <= 1e-5
    assert float(jnp.max(jnp.abs(got_out[2]))) == 0.0  # the row with no token
    for got, want in zip(got_grads, want_grads, strict=True):
        assert bool(jnp.all(jnp.isfinite(got)))
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5
    assert float(jnp.max(jnp.abs(want_grads[1]))) > 1e-2  # the keys' gradients are real


def test_kernel_with_heads_it_cannot_split_over_tensor_still_equals_dense() -> None:
    """One k/v head (MQA) over tensor 2: the heads stay whole inside the kernel; context 4 hops 4 times."""
    x = masked_inputs(1)
    x["k"], x["v"] = x["k"][:, :, :1], x["v"][:, :, :1]
    want_out, want_grads = jax.jit(lambda: value_and_grads(dense_reference(x, False), x))()
    with jax.set_mesh(mesh(1, 4, 2)):
        got_out, got_grads = jax.jit(lambda: value_and_grads(context_version(x, False, "ring", 512), x))()
    assert float(jnp.max(jnp.abs(got_out - want_out))) <= 1e-5
    for got, want in zip(got_grads, want_grads, strict=True):
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5


def test_dispatch_picks_the_context_kernel_only_where_the_length_splits() -> None:
    config = bench_cp.model_config("padded", context=4).model.block
    assert choose_implementation(config, train=True, length=16)[0] != "context"  # no mesh
    with jax.sharding.use_abstract_mesh(mesh(2, 4, 1).abstract_mesh), nn.logical_axis_rules(DEFAULT_RULES):
        with context_strategy("ring"):
            impl, why = choose_implementation(config, train=True, length=16)
        assert impl == "context" and "('context',) (4 shards)" in why and "ring" in why
        assert choose_implementation(config, train=True, length=14)[0] != "context"


# --- through the training runner --------------------------------------------------------------------------


def classifier_config(parallel: dict[str, Any], **data: Any) -> Any:
    return config_from_dict({
        "model": {"vocab_size": 32, "num_classes": 2, "max_len": 16, "num_layers": 1,
                  "block": {"model_dim": 32, "num_heads": 4, "ffn_dim": 64, "attention": {"causal": True}}},
        "data": {"buckets": [16], "max_len": 16, **data},
        "optim": {"optimizer": "sgd", "lr": 0.25, "schedule": "constant", "warmup_steps": 0, "clip_norm": None},
        "train": {"batch_size": 8, "steps": 3}, "parallel": parallel,
    })


def batches(length: int) -> list[dict[str, np.ndarray]]:
    out = []
    for step in range(3):
        r = np.random.default_rng(step)
        valid = np.arange(length)[None, :] < r.integers(2, length + 1, 8)[:, None]
        out.append({"tokens": np.where(valid, r.integers(1, 32, (8, length)), 0).astype(np.int32),
                    "valid_tokens": valid, "labels": r.integers(0, 2, 8).astype(np.int32)})
    return out


def train(config: Any, length: int) -> tuple[list[float], Any]:
    model = Classifier(config.model)
    params = jax.jit(lambda: init_params(model, 0, 16))()
    state = create_state(model, params, config.optim, 3)
    runner = make_runner(config, state, specs=abstract_init(model, 16)[1])
    state = runner.place_state(state)
    losses = []
    for step, batch in enumerate(batches(length)):
        state, metrics = runner.train_step(state, batch, jax.random.key(step))
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(runner.unreplicate(state).params)


@pytest.mark.slow
def test_training_with_a_length_that_does_not_divide_equals_one_device(caplog: pytest.LogCaptureFixture) -> None:
    """14 tokens over context 4 are padded to 16 (said once) and masked: 3 SGD steps on data 2 x context 4 give
    one device's losses and parameters (SGD: the parameters carry every gradient)."""
    want_losses, want_params = train(classifier_config({"strategy": "single"}), 14)
    with caplog.at_level(logging.WARNING, logger="train.devices.runners"):
        got_losses, got_params = train(classifier_config({"strategy": "sharded", "mesh": {"data": 2, "context": 4},
                                                          "context_strategy": "ring"}), 14)
    np.testing.assert_allclose(got_losses, want_losses, atol=1e-5, rtol=0)
    assert np.ptp(want_losses) > 1e-3
    for got, want in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    padded = [r.getMessage() for r in caplog.records if "padded to 16" in r.getMessage()]
    assert padded == ["parallel: sequences of 14 tokens are padded to 16 (a multiple of parallel.mesh.context=4); "
                      "the added positions are masked"]


def test_a_length_the_mesh_cannot_serve_and_a_rule_without_length_fail_in_one_line() -> None:
    config = classifier_config({"strategy": "sharded", "mesh": {"data": 2, "context": 4}}, buckets=[14], max_len=14)
    config = config.model_copy(update={"model": config.model.model_copy(update={"max_len": 14})})
    model = Classifier(config.model)
    with pytest.raises(ConfigError, match=r"context=4 pads sequences of 14 tokens to 16, beyond model.max_len=14: "
                                          "use data.buckets and data.max_len that are multiples of 4") as err:
        make_runner(config, jax.eval_shape(lambda: create_state(model, init_params(model, 0, 14), config.optim, 3)),
                    specs=abstract_init(model, 14)[1])
    assert "\n" not in str(err.value)
    rules = [[a, b] for a, b in DEFAULT_RULES if a != "length"]
    with pytest.raises(ConfigError, match=r"parallel.mesh.context=4 but parallel.rules maps 'length' to None: add "
                                          r"the rule \[length, context\]"):
        classifier_config({"mesh": {"data": 2, "context": 4}, "rules": rules})
    with pytest.raises(ConfigError, match="context_strategy"):
        classifier_config({"mesh": {"context": 2}, "context_strategy": "tree"})


# --- slow: the grid, and the command line --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", bench_cp.KINDS)
def test_equality_grid_strategy_by_context_size(kind: str) -> None:
    """The bench's equality table for one mask kind: both strategies at C = 2 (fsdp 2 x tensor 2 beside it),
    4 (data 2) and 8: loss, logits, encoder output and every gradient within 1e-5 of one device's."""
    rows = bench_cp.equality_rows(kinds=(kind,))
    assert len(rows) == len(bench_cp.SHARDS) * len(bench_cp.STRATEGIES)
    for row in rows:
        assert row["kernel_collective"], row
        assert max(row["loss"], row["logits"], row["hidden"], row["grads"]) <= 1e-5, row
        assert row["grad_scale"] > 1e-2, row


def child_env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return env


def cli_losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


@pytest.mark.slow
def test_cli_context_4_trains_like_one_device_and_resumes_with_context_2(tmp_path: Path) -> None:
    """The real command, tiny config with residual dropout (L = 16): one device trains 10 steps; data 2 x context 4
    trains 6 (checkpoint at 6), then data 4 x context 2 resumes to 10. Every step's loss agrees."""
    def command(workdir: Path, *overrides: str) -> list[str]:
        return [sys.executable, "-m", "train", "--config", "configs/tiny.yaml", "--workdir", str(workdir),
                "train.progress=false", "train.log_every=1", "train.eval_every=100", "checkpoint.every=6",
                "optim.schedule=constant", "optim.warmup_steps=0", "model.block.residual_dropout=0.1", *overrides]

    def run(args: list[str]) -> str:
        done = subprocess.run(args, cwd=ROOT, env=child_env(8), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr + done.stdout

    one, split = tmp_path / "one", tmp_path / "split"
    run(command(one, "train.steps=10", "parallel.strategy=single"))
    first = run(command(split, "train.steps=6", "parallel.mesh.data=2", "parallel.mesh.context=4"))
    assert "padded" not in first  # 16 tokens split over 4 without padding
    run(command(split, "train.steps=10", "parallel.mesh.data=4", "parallel.mesh.context=2",
                "parallel.context_strategy=ring"))
    want, got = cli_losses(one), cli_losses(split)
    assert sorted(got) == sorted(want) == list(range(1, 11))
    np.testing.assert_allclose([got[s] for s in range(1, 11)], [want[s] for s in range(1, 11)], atol=1e-5, rtol=0)
    assert np.ptp([want[s] for s in range(1, 11)]) > 1e-3


@pytest.mark.slow
def test_cli_refuses_a_length_the_mesh_cannot_serve_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "train", "--config", "configs/tiny.yaml", "--workdir", str(tmp_path / "w"),
         "parallel.mesh.context=8", "parallel.mesh.data=1", "model.max_len=15", "data.max_len=15", "data.buckets=[15]",
         "data.synthetic_len=15"],
        cwd=ROOT, env=child_env(8), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "pads sequences of 15 tokens to 16, beyond model.max_len=15" in done.stderr
    assert not (tmp_path / "w").exists()
