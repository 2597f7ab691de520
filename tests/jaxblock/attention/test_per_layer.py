"""Per-layer attention settings of the stack (StackConfig.layers: window, rope_base, attn_norm).

Tiny models: D=16, 2 heads, 3 layers (two windowed with different windows and RoPE bases, one global),
N=2 rows of L=12, row 1 with 7 real tokens. The settings are scanned inputs, so scan and the unrolled
stack compute the same, for every CPU kernel and with remat.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pydantic import ValidationError

from jaxblock import Classifier, Encoder, EncoderConfig
from jaxblock import diagnostics as dg
from jaxblock.attention import choose_implementation
from jaxblock.model import stack_layer_params

N, L, V = 2, 12, 30
VALID = jnp.arange(L)[None, :] < jnp.asarray([[L], [7]])
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, V, (N, L)), jnp.int32)
PER_LAYER = dict(window=(2, None, 1), rope_base=(100.0, 10000.0, 30.0), attn_norm=(False, True, True))


def _cfg(kernel: str = "xla", *, layers: dict[str, Any] | None = None, rope: bool = True,
         **extra: Any) -> EncoderConfig:
    """The per-layer stack with rotary positions (`layers` updates PER_LAYER)."""
    fields: dict[str, Any] = dict(num_layers=3, vocab_size=V, max_len=L, num_classes=3,
                                  embedding=dict(positions="none" if rope else "learned"))
    block = dict(model_dim=16, num_heads=2, ffn_dim=24, attention=dict(kernel=kernel, chunk_size=4, rope=rope))
    return EncoderConfig(**(fields | extra), layers=PER_LAYER | (layers or {}), block=block)


def _without(cfg: EncoderConfig, name: str) -> EncoderConfig:
    """`cfg` without per-layer setting `name`."""
    return cfg.model_copy(update={"layers": cfg.layers.model_copy(update={name: None})})


def _init(cfg: EncoderConfig, model: Any = Encoder) -> Any:
    return nn.unbox(model(cfg).init(jax.random.key(0), TOKENS, VALID))


@functools.cache
def _variables() -> Any:
    """The variables of Encoder(_cfg()), initialised once: every kernel has this parameter tree (read only)."""
    return _init(_cfg())


@pytest.mark.parametrize(
    "attention",
    ["xla", pytest.param("unfused", marks=pytest.mark.slow), pytest.param("chunked", marks=pytest.mark.slow)],
)
def test_scan_and_remat_equal_the_unrolled_stack(attention: str) -> None:
    cfg = _cfg(attention)
    variables = _variables()
    want = np.asarray(Encoder(cfg).apply(variables, TOKENS, VALID))
    scanned = cfg.model_copy(update={"scan_layers": True, "remat": "full"})
    got = np.asarray(Encoder(scanned).apply({"params": stack_layer_params(variables["params"])}, TOKENS, VALID))
    np.testing.assert_allclose(got[np.asarray(VALID)], want[np.asarray(VALID)], atol=1e-6, rtol=1e-6)


def test_every_kernel_computes_the_same_windows() -> None:
    outs = {a: np.asarray(Encoder(_cfg(a)).apply(_variables(), TOKENS, VALID)) for a in ("xla", "unfused", "chunked")}
    for a in ("unfused", "chunked"):
        np.testing.assert_allclose(outs[a][np.asarray(VALID)], outs["xla"][np.asarray(VALID)], atol=2e-6)


def test_a_window_is_the_attention_mask_it_stands_for_and_each_setting_matters() -> None:
    """One windowed layer equals the same layer given |i - j| <= w as an explicit attn_mask; dropping any
    per-layer setting changes the output (so none is silently ignored)."""
    cfg = _cfg()
    variables = _variables()
    out = np.asarray(Encoder(cfg).apply(variables, TOKENS, VALID))
    one = _cfg(num_layers=1, layers=dict(window=(2,), rope_base=(100.0,), attn_norm=None))
    v1 = _init(one)
    idx = np.arange(L)
    band = jnp.asarray(np.abs(idx[:, None] - idx[None, :]) <= 2)
    plain = _without(one, "window")
    np.testing.assert_allclose(np.asarray(Encoder(one).apply(v1, TOKENS, VALID)),
                               np.asarray(Encoder(plain).apply(v1, TOKENS, VALID, attn_mask=band)), atol=1e-6)
    for name in PER_LAYER:
        without = np.asarray(Encoder(_without(cfg, name)).apply(variables, TOKENS, VALID))
        assert np.abs(without - out)[np.asarray(VALID)].max() > 1e-3, name


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_padding_changes_no_real_output_or_logit(scan: bool) -> None:
    cfg = _cfg(scan_layers=scan, pooler=dict(pooling="mean"))
    params = _init(cfg, Classifier)["params"]
    other = TOKENS.at[1, 7:].set(3)  # different ids at row 1's padded positions
    enc = lambda t: np.asarray(Encoder(cfg).apply({"params": params["encoder"]}, t, VALID))
    assert np.abs(enc(other)[1, :7] - enc(TOKENS)[1, :7]).max() == 0.0
    logits = lambda t: np.asarray(Classifier(cfg).apply({"params": params}, t, VALID))
    assert np.abs(logits(other) - logits(TOKENS)).max() == 0.0


def test_a_packed_row_equals_its_examples_run_separately() -> None:
    cfg = _cfg()
    variables = _variables()
    first, second = [3, 1, 4, 1, 5], [9, 2, 6, 5]
    # Row 1 (one segment) gives the batch the file's shared [N, L] shape: its compiled operations are reused.
    packed = jnp.asarray([first + second + [0] * 3, TOKENS[1].tolist()], jnp.int32)
    seg = jnp.asarray([[0] * 5 + [1] * 4 + [0] * 3, [0] * L], jnp.int32)
    valid = jnp.asarray([[True] * 9 + [False] * 3, VALID[1].tolist()])
    alone = jnp.asarray([first + [0] * 7, second + [0] * 8], jnp.int32)
    alone_valid = jnp.asarray([[True] * 5 + [False] * 7, [True] * 4 + [False] * 8])
    h_packed = np.asarray(Encoder(cfg).apply(variables, packed, valid, segment_ids=seg))
    h_alone = np.asarray(Encoder(cfg).apply(variables, alone, alone_valid))
    np.testing.assert_allclose(h_packed[0, :5], h_alone[0, :5], atol=1e-5)
    np.testing.assert_allclose(h_packed[0, 5:9], h_alone[1, :4], atol=1e-5)


def test_cudnn_is_not_chosen_for_a_windowed_layer() -> None:
    block = _cfg().block.model_copy(update={"dtype": "bfloat16"}).with_kernel("auto")
    impl, why = choose_implementation(block, train=False, backend="gpu", extra_mask=True)
    assert impl == "xla" and "attn_mask" in why
    impl, why = choose_implementation(block.with_kernel("cudnn"), train=False, backend="gpu",
                                      extra_mask=True)
    assert impl == "xla" and "cuDNN requested" in why


@pytest.mark.slow  # every diagnostic compiles its own programs: ~15 s on 2 shared cores
def test_the_diagnostics_pass_on_a_per_layer_stack() -> None:
    model = Classifier(_cfg(pooler=dict(pooling="mean")))
    batch = {"tokens": TOKENS, "valid_tokens": VALID, "labels": jnp.asarray([0, 2], jnp.int32)}

    def loss(logits: jax.Array, b: Any) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    d = dg.run_all(model, model.init(jax.random.key(0), TOKENS, VALID), batch, loss)
    assert d.failed == [], "\n".join(str(r) for r in d.results)
    assert len(d.ratios.attn) == 3


@pytest.mark.parametrize(("update", "message"), [
    ({"layers": {"window": (1, 2)}}, "layers.window has 2 entries for num_layers=3"),
    ({"layers": {"window": (1, -2, None)}}, "a window is a distance >= 0"),
    ({"rope": False, "layers": {"window": None}}, "layers.rope_base needs rotary positions"),
])
def test_bad_per_layer_settings_are_refused_in_one_line(update: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as err:
        _cfg(**update)
    assert message in str(err.value)


def test_the_pytorch_interop_refuses_per_layer_settings_in_one_line() -> None:
    pytest.importorskip("torch")
    from jaxblock.interop.torch import to_torch

    cfg = _cfg(rope=False, layers=dict(rope_base=None))
    with pytest.raises(ValueError) as err:
        to_torch(cfg, _init(cfg)["params"]["stack"])
    assert "\n" not in str(err.value) and "layers.window" in str(err.value)


@pytest.mark.parametrize("attention", [pytest.param("xla", marks=pytest.mark.slow), "chunked"])
def test_non_finite_padding_reaches_no_gradient_of_a_per_layer_stack(attention: str) -> None:
    """As tests/jaxblock/test_padding_gradients.py checks the uniform stack: NaN/Inf at padded positions of x leave
    real outputs and every parameter gradient bitwise unchanged."""
    from jaxblock import EncoderStack, StackConfig

    cfg = StackConfig(num_layers=3, layers=PER_LAYER, block=dict(
        model_dim=16, num_heads=2, ffn_dim=24, attention=dict(rope=True, kernel=attention, chunk_size=4)))
    stack = EncoderStack(cfg)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(N, L, 16)), jnp.float32)
    params = _variables()["params"]["stack"]  # the Encoder's stack: the same parameter tree
    weights = jnp.asarray(np.random.default_rng(2).normal(size=(N, L, 16)), jnp.float32)

    def loss(p: Any, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = stack.apply({"params": p}, inputs, VALID)
        return jnp.sum(jnp.where(VALID[..., None], out * weights, 0.0)), out

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (_, clean_out), clean = grad(params, x)
    for poison in (np.nan, np.inf, -np.inf):
        (_, out), got = grad(params, jnp.where(VALID[..., None], x, poison))
        assert np.array_equal(np.asarray(out)[np.asarray(VALID)], np.asarray(clean_out)[np.asarray(VALID)])
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(clean), strict=True):
            assert np.all(np.isfinite(np.asarray(a))) and np.array_equal(np.asarray(a), np.asarray(b))
