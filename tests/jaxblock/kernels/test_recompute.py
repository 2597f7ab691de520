"""jaxblock/kernels/recompute.py: on a GPU the norms, the FFN's activation and dropout keep only their inputs for
the backward (counted with jax.ad_checkpoint.print_saved_residuals), with the gradients of plain autodiff; on a CPU
or a TPU and with gradients=plain, autodiff's own residuals."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock.attention.platform import for_platform
from jaxblock.config import BlockConfig
from jaxblock.ffn import FeedForward
from jaxblock.kernels import recompute
from jaxblock.kernels.dropout import Dropout
from jaxblock.norms import make_norm

N, L, D, F = 2, 8, 16, 64


def residuals(fn, *args) -> list[str]:
    """The shapes ('f32[2,8,16]') of what the backward of fn(*args) keeps, from print_saved_residuals."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    return [m.group(0) for m in re.finditer(r"^\w+\[[\d,]*\]", out.getvalue(), re.M)]


def block_config(**kw) -> BlockConfig:
    return BlockConfig(model_dim=D, num_heads=2, ffn_dim=F, dtype="bfloat16", **kw)


def test_the_choice_by_platform_and_config() -> None:
    with for_platform("gpu"):
        assert recompute.kernel()[0] == "recomputed" and recompute.kernel("plain")[0] == "saved"
    for platform in ("cpu", "tpu"):
        with for_platform(platform):
            kernel, reason = recompute.kernel()
            assert kernel == "saved" and platform.upper() in reason


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_a_norm_on_a_gpu_keeps_its_bfloat16_input_not_float32_copies(norm_type: str) -> None:
    x = jax.random.normal(jax.random.key(0), (N, L, D), jnp.bfloat16)

    def kept(platform: str, gradients: str = "auto") -> list[str]:
        norm = make_norm(block_config(norm_type=norm_type, gradients=gradients))
        with for_platform(platform):
            params = norm.init(jax.random.key(1), x)
            return residuals(lambda p, x: jnp.sum(norm.apply(p, x).astype(jnp.float32)), params, x)

    big = f"[{N},{L},{D}]"
    assert f"bf16{big}" in kept("gpu") and f"f32{big}" not in kept("gpu")
    for platform, gradients in (("cpu", "auto"), ("tpu", "auto"), ("gpu", "plain")):
        assert f"f32{big}" in kept(platform, gradients), (platform, gradients)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("ffn_dropout", [0.0, 0.25])
def test_the_ffn_on_a_gpu_keeps_its_pre_activations_only(activation: str, ffn_dropout: float) -> None:
    x = jax.random.normal(jax.random.key(0), (N, L, D), jnp.bfloat16)
    ffn = FeedForward(block_config(activation=activation, ffn_dropout=ffn_dropout))
    params = ffn.init(jax.random.key(1), x)

    def kept(platform: str) -> list[str]:
        def loss(p, x):
            y = ffn.apply(p, x, train=True, rngs={"dropout": jax.random.key(2)})
            return jnp.sum(y.astype(jnp.float32))

        with for_platform(platform):
            return residuals(loss, params, x)

    hidden = f"bf16[{N},{L},{F}]"
    # The pre-activation, and the gate's with a GLU; the keep mask (bool) is redrawn from the rng on a GPU.
    assert kept("gpu").count(hidden) == (2 if activation == "swiglu" else 1)
    assert min(kept("cpu").count(hidden), kept("tpu").count(hidden)) > kept("gpu").count(hidden)
    assert kept("gpu").count(f"bool[{N},{L},{F}]") == 0
    assert kept("cpu").count(f"bool[{N},{L},{F}]") == (ffn_dropout > 0)


@pytest.mark.parametrize("gradients", ["auto", "plain"])
def test_dropout_on_a_gpu_redraws_its_mask_instead_of_keeping_it(gradients: str) -> None:
    x = jax.random.normal(jax.random.key(0), (N, L, D), jnp.bfloat16)
    drop = Dropout(0.25, gradients=gradients)

    def kept(platform: str) -> list[str]:
        def loss(x):
            y = drop.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
            return jnp.sum(y.astype(jnp.float32))

        with for_platform(platform):
            return residuals(loss, x)

    mask = f"bool[{N},{L},{D}]"
    assert kept("cpu").count(mask) == 1 and kept("tpu").count(mask) == 1
    assert kept("gpu").count(mask) == (gradients == "plain")

    def value_and_grad(platform: str):
        cot = jax.random.normal(jax.random.key(3), (N, L, D), jnp.float32)

        def loss(x):
            return jnp.sum(drop.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(2)}) * cot)

        with for_platform(platform):
            return jax.jit(jax.value_and_grad(loss))(x.astype(jnp.float32))

    (got_v, got_g), (want_v, want_g) = value_and_grad("gpu"), value_and_grad("tpu")
    assert float(got_v) == float(want_v)
    np.testing.assert_array_equal(np.asarray(got_g), np.asarray(want_g))


@pytest.mark.parametrize("module", ["layernorm", "rmsnorm", "ffn"])
def test_recomputed_gradients_are_plain_autodiffs(module: str) -> None:
    x = jax.random.normal(jax.random.key(0), (N, L, D), jnp.float32) * 3 + 1
    cot = jax.random.normal(jax.random.key(3), (N, L, D), jnp.float32)

    def grads(gradients: str):
        cfg = BlockConfig(model_dim=D, num_heads=2, ffn_dim=F, gradients=gradients, ffn_dropout=0.25,
                          norm_type="rmsnorm" if module == "rmsnorm" else "layernorm")
        layer = FeedForward(cfg) if module == "ffn" else make_norm(cfg)
        kw = {"train": True} if module == "ffn" else {}
        params = layer.init(jax.random.key(1), x)

        def loss(p, x):
            return jnp.sum(layer.apply(p, x, rngs={"dropout": jax.random.key(2)}, **kw) * cot)

        with for_platform("gpu"):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    (got_v, got_g), (want_v, want_g) = grads("auto"), grads("plain")
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
