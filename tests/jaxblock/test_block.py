"""EncoderBlock: the two placements (and their description in jaxblock.wiring), padding invariance,
sublayer ablation, train vs eval, distinct norms, bf16, fully masked rows, segments, ToNNX, and input checks.

Shapes: N=2, L=5, D=8, H=2, F=16; row 0 has 3 real tokens, row 1 has 5.
"""

import functools
import itertools
from typing import ClassVar

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxblock import BlockConfig, EncoderBlock, FeedForward, LayerNorm, RMSNorm, SelfAttention, unbox
from jaxblock.block import RECORDED_SITES
from jaxblock.diagnostics.reference import norm as reference_norm
from jaxblock.initializers import abstract_params
from jaxblock.wiring import BLOCK_INPUT, WIRINGS

N, L, D = 2, 5, 8
VALID = jnp.array([[True, True, True, False, False], [True] * L])
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")


def _cfg(**kw) -> BlockConfig:
    return BlockConfig(**{**dict(model_dim=D, num_heads=2, ffn_dim=16), **kw})


def _shapes(cfg: BlockConfig) -> dict:
    x = jax.ShapeDtypeStruct((N, L, cfg.model_dim), jnp.float32)
    v = jax.ShapeDtypeStruct((N, L), jnp.bool_)
    return jax.eval_shape(lambda a, b: unbox(EncoderBlock(cfg).init(jax.random.key(0), a, b)), x, v)["params"]


def _params(cfg: BlockConfig, seed: int = 0) -> dict:
    """Host-drawn random parameters: norm scales near 1, everything else (biases too) non-zero."""
    rng = np.random.default_rng(seed)

    def draw(path, s):
        centre = 1.0 if path[-1].key == "scale" else 0.0
        return jnp.asarray(centre + rng.normal(0.0, 0.4, s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(draw, _shapes(cfg))


def _x(seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(N, L, D)), jnp.float32)


def _apply(cfg, params, x, valid=VALID, **kw):
    return EncoderBlock(cfg).apply({"params": params}, x, valid, **kw)


def _intermediates(cfg, params, x, valid=VALID, **kw) -> tuple[np.ndarray, dict]:
    y, state = _apply(cfg, params, x, valid, mutable=["intermediates"], **kw)
    rec = state["intermediates"]  # the unfused path adds a nested self_attn/attention_weights
    return np.asarray(y), {k: np.asarray(v[0]) for k, v in rec.items() if isinstance(v, tuple)} | {
        k: v for k, v in rec.items() if not isinstance(v, tuple)
    }


def _norm(cfg, params, x):
    cls = RMSNorm if cfg.norm_type == "rmsnorm" else LayerNorm
    return cls(cfg).apply({"params": params}, x)


# --- padding invariance -----------------------------------------------------------------------


# Each placement, norm type and activation, and each placement with each norm type, in the default suite (five
# blocks); the rest of the grid under -m slow.
_PADDING_DEFAULT = {("pre", "layernorm", "relu"), ("post", "rmsnorm", "gelu"), ("pre", "rmsnorm", "gelu_tanh"),
                    ("post", "layernorm", "swiglu"), ("pre", "layernorm", "geglu")}


@pytest.mark.parametrize(("norm", "norm_type", "activation"), [
    case if case in _PADDING_DEFAULT else pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product(["pre", "post"], ["layernorm", "rmsnorm"], ACTIVATIONS)
])
def test_padding_invariance_and_its_failure_without_the_key_mask(norm, norm_type, activation):
    cfg = _cfg(norm=norm, norm_type=norm_type, activation=activation)
    params = _params(cfg)
    x = _x()
    noisy = x.at[0, 3:].set(50.0 * _x(2)[0, :2])  # only row 0's padded positions change
    y, y_noisy = np.asarray(_apply(cfg, params, x)), np.asarray(_apply(cfg, params, noisy))
    np.testing.assert_allclose(y_noisy[0, :3], y[0, :3], atol=1e-6)
    np.testing.assert_array_equal(y_noisy[1], y[1])
    # The same check with the key mask removed fails: real tokens now attend to the padding.
    unmasked = jnp.ones((N, L), bool)
    z, z_noisy = (np.asarray(_apply(cfg, params, a, unmasked)) for a in (x, noisy))
    assert np.abs(z_noisy[0, :3] - z[0, :3]).max() > 1e-2


# --- sublayer ablation, and the wiring of each placement --------------------------------------


def _zero(params, *path):
    """A copy of params with the module at `path` (kernel and bias) set to zero."""
    out = jax.tree.map(lambda a: a, params)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = jax.tree.map(jnp.zeros_like, node[path[-1]])
    return out


def test_pre_ln_ablation_reduces_to_the_other_branch_plus_identity():
    cfg = _cfg()
    params, x = _params(cfg), _x()
    no_attn = _zero(params, "self_attn", "out")
    ffn_only = x + FeedForward(cfg).apply({"params": params["ffn"]}, _norm(cfg, params["ffn_norm"], x))
    np.testing.assert_allclose(np.asarray(_apply(cfg, no_attn, x)), np.asarray(ffn_only), atol=1e-6)

    no_ffn = _zero(params, "ffn", "linear2")
    mha = SelfAttention(cfg).apply({"params": params["self_attn"]}, _norm(cfg, params["attn_norm"], x), VALID)
    np.testing.assert_allclose(np.asarray(_apply(cfg, no_ffn, x)), np.asarray(x + mha), atol=1e-6)

    neither = _zero(no_attn, "ffn", "linear2")
    np.testing.assert_array_equal(np.asarray(_apply(cfg, neither, x)), np.asarray(x))  # exactly the identity


def test_ablate_config_equals_a_zeroed_branch():
    cfg = _cfg()
    params, x = _params(cfg), _x()
    no_attn = _zero(params, "self_attn", "out")
    ablated = cfg.model_copy(update={"ablate": "attention"})
    trimmed = {k: v for k, v in params.items() if k != "self_attn"}
    assert set(_shapes(ablated)) == set(trimmed)  # the branch's parameters are gone, not just unused
    np.testing.assert_allclose(
        np.asarray(_apply(ablated, trimmed, x)), np.asarray(_apply(cfg, no_attn, x)), atol=1e-6
    )


def test_post_ln_with_both_branches_zeroed_is_the_two_norms():
    cfg = _cfg(norm="post")
    params, x = _params(cfg), _x()
    neither = _zero(_zero(params, "self_attn", "out"), "ffn", "linear2")
    expected = _norm(cfg, params["ffn_norm"], _norm(cfg, params["attn_norm"], x))
    np.testing.assert_allclose(np.asarray(_apply(cfg, neither, x)), np.asarray(expected), atol=1e-6)


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_recorded_intermediates_follow_the_equations(norm):
    cfg = _cfg(norm=norm)
    params, x = _params(cfg), _x()
    y, r = _intermediates(cfg, params, x)
    ln1 = lambda a: np.asarray(_norm(cfg, params["attn_norm"], jnp.asarray(a)))
    ln2 = lambda a: np.asarray(_norm(cfg, params["ffn_norm"], jnp.asarray(a)))
    close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5)
    if norm == "pre":  # U = X + MHA(LN1(X)), Y = U + FFN(LN2(U))
        close(r["norm1"], ln1(x))
        close(r["after_attn"], np.asarray(x) + r["attn_branch"])
        close(r["norm2"], ln2(r["after_attn"]))
        close(r["after_ffn"], r["after_attn"] + r["ffn_branch"])
        close(y, r["after_ffn"])  # no norm after the last add
    else:  # U = LN1(X + MHA(X)), Y = LN2(U + FFN(U))
        close(r["after_attn"], np.asarray(x) + r["attn_branch"])
        close(r["norm1"], ln1(r["after_attn"]))
        close(r["after_ffn"], r["norm1"] + r["ffn_branch"])
        close(r["norm2"], ln2(r["after_ffn"]))
        close(y, r["norm2"])
    ffn_in = r["norm2"] if norm == "pre" else r["norm1"]
    close(r["ffn_branch"], np.asarray(FeedForward(cfg).apply({"params": params["ffn"]}, jnp.asarray(ffn_in))))


def test_post_ln_output_is_normalized_per_token_and_pre_ln_output_is_not():
    post = _cfg(norm="post")
    params = _params(post)
    params["ffn_norm"] = {"scale": jnp.ones(D), "bias": jnp.zeros(D)}  # the default affine
    y = np.asarray(_apply(post, params, 3.0 * _x()))
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-3)  # eps=1e-5 shrinks the variance by ~1e-5 / var
    pre = np.asarray(_apply(_cfg(), params, 3.0 * _x()))
    assert np.abs(pre.var(-1) - 1.0).max() > 0.5


# --- train vs eval ----------------------------------------------------------------------------


def test_eval_is_deterministic_and_training_draws_differ_by_key():
    cfg = _cfg(attention=dict(dropout=0.2), ffn_dropout=0.2, residual_dropout=0.2)
    params, x = _params(cfg), _x()
    eval_a, eval_b = _apply(cfg, params, x), _apply(cfg, params, x, rngs={"dropout": jax.random.key(5)})
    np.testing.assert_array_equal(np.asarray(eval_a), np.asarray(eval_b))
    step = jax.jit(lambda k: _apply(cfg, params, x, train=True, rngs={"dropout": k}))  # one compile
    train = lambda k: np.asarray(step(jax.random.key(k)))
    np.testing.assert_array_equal(train(0), train(0))
    assert np.abs(train(0) - train(1)).max() > 1e-2
    assert np.abs(train(0) - np.asarray(eval_a)).max() > 1e-2


def test_without_dropout_training_equals_eval():
    cfg = _cfg()
    params, x = _params(cfg), _x()
    np.testing.assert_array_equal(
        np.asarray(_apply(cfg, params, x, train=True, rngs={"dropout": jax.random.key(0)})),
        np.asarray(_apply(cfg, params, x)),
    )


@pytest.mark.parametrize("site", ["attention.dropout", "ffn_dropout", "residual_dropout"])
def test_each_dropout_site_alone_changes_the_training_output(site):
    cfg = _cfg(attention=dict(dropout=0.5)) if site == "attention.dropout" else _cfg(**{site: 0.5})
    params, x = _params(cfg), _x()
    y_eval, r_eval = _intermediates(cfg, params, x)
    y_train, r_train = _intermediates(cfg, params, x, train=True, rngs={"dropout": jax.random.key(0)})
    assert np.abs(y_train - y_eval).max() > 1e-2
    # The attention branch sees the same LN1(x) in both modes, so where it differs tells the site apart.
    a_eval, a_train = r_eval["attn_branch"], r_train["attn_branch"]
    if site == "ffn_dropout":
        np.testing.assert_allclose(a_train, a_eval, atol=1e-6)  # only the FFN hidden layer is dropped
    elif site == "residual_dropout":
        kept = a_train != 0.0  # branch output elements are zeroed or scaled by 1 / (1 - p)
        np.testing.assert_allclose(a_train[kept], 2.0 * a_eval[kept], rtol=1e-5)
        assert 0.3 < kept.mean() < 0.7
    else:  # dropped attention weights: no zeros in the branch output, but different values
        assert "self_attn" not in r_eval and "self_attn" not in r_train  # the dense kernel ran (CPU), not unfused
        assert np.all(a_train != 0.0)
        assert np.abs(a_train - a_eval).max() > 1e-2


# --- two norms, two placements ------------------------------------------------------------------


def test_two_distinct_norm_instances():
    cfg = _cfg()
    params, x = _params(cfg), _x()
    assert {"attn_norm", "ffn_norm"} <= set(params)
    base = np.asarray(_apply(cfg, params, x))
    moved = []
    for name in ("attn_norm", "ffn_norm"):
        p = dict(params)
        p[name] = {**params[name], "scale": params[name]["scale"] * 2.0}
        moved.append(np.asarray(_apply(cfg, p, x)) - base)
    assert np.abs(moved[0]).max() > 1e-2 and np.abs(moved[1]).max() > 1e-2
    assert np.abs(moved[0] - moved[1]).max() > 1e-2


def test_pre_and_post_ln_differ_from_the_same_weights():
    params, x = _params(_cfg()), _x()
    pre = np.asarray(_apply(_cfg(norm="pre"), params, x))
    post = np.asarray(_apply(_cfg(norm="post"), params, x))
    assert np.abs(pre - post).max() > 0.1


def test_parameter_count_without_bias():
    cfg = BlockConfig(model_dim=16, num_heads=4, ffn_dim=64, use_bias=False)
    count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(_shapes(cfg)))
    assert count == 12 * 16 * 16 + 2 * 16  # 4D^2 attention + 8D^2 FFN + two norm scales


# --- bfloat16 compute, float32 parameters -----------------------------------------------------


def test_bfloat16_computes_in_bf16_with_float32_params():
    cfg = _cfg(dtype="bfloat16")
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(_shapes(cfg)))
    params, x = _params(_cfg()), _x()
    y16, r16 = _intermediates(cfg, params, x)
    assert y16.dtype == jnp.bfloat16
    assert r16["attn_branch"].dtype == jnp.bfloat16 and r16["ffn_branch"].dtype == jnp.bfloat16
    y32 = np.asarray(_apply(_cfg(), params, x))
    y16 = y16.astype(np.float32)
    assert np.all(np.isfinite(y16))
    # Values are O(1-10); bf16 keeps 8 bits of mantissa, and a block rounds a few dozen times.
    np.testing.assert_allclose(y16, y32, atol=0.1, rtol=0.05)
    assert np.abs(y16 - y32).max() > 0.0  # it really ran in lower precision


# --- fully masked rows, segments ---------------------------------------------------------------


@pytest.mark.parametrize("impl", ["xla", "unfused", "chunked", "dense"])
def test_fully_masked_row_is_finite_and_its_attention_branch_is_the_out_bias(impl):
    cfg = _cfg(attention=dict(kernel=impl, chunk_size=2))
    params, x = _params(cfg), _x()
    valid = VALID.at[0].set(False)
    y, r = _intermediates(cfg, params, x, valid)
    bias = np.asarray(params["self_attn"]["out"]["bias"])
    np.testing.assert_array_equal(r["attn_branch"][0], np.broadcast_to(bias, (L, D)))
    assert np.all(np.isfinite(y))


def test_fully_masked_row_has_finite_block_gradients():
    # Each attention path's own gradients are checked in test_attention; here the whole block's.
    cfg = _cfg()
    params, x = _params(cfg), _x()
    valid = VALID.at[0].set(False)
    grads = jax.jit(jax.grad(lambda p, a: jnp.sum(_apply(cfg, p, a, valid) ** 2), argnums=(0, 1)))(params, x)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert np.abs(np.asarray(grads[1][0])).max() > 0.0  # the row still trains through its FFN branch


def test_tokens_of_one_segment_never_see_another():
    cfg = _cfg()
    params, x = _params(cfg), _x()
    seg = jnp.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]], jnp.int32)
    valid = jnp.ones((N, L), bool)
    changed = x.at[0, 3:].add(3.0).at[1, 2:].add(3.0)  # every segment-1 token changes
    a = np.asarray(_apply(cfg, params, x, valid, segment_ids=seg))
    b = np.asarray(_apply(cfg, params, changed, valid, segment_ids=seg))
    np.testing.assert_allclose(b[0, :3], a[0, :3], atol=1e-6)
    np.testing.assert_allclose(b[1, :2], a[1, :2], atol=1e-6)
    c = np.asarray(_apply(cfg, params, changed, valid))  # one segment: segment 0 does see the change
    assert np.abs(c[0, :3] - a[0, :3]).max() > 1e-2


# --- interop with NNX, input checks -------------------------------------------------------------


def test_works_inside_nnx_bridge_to_nnx():
    cfg = _cfg()
    x = _x()
    # Our parameters carry logical axis names; NNX's eager sharding would need a mesh to place them.
    with nnx.use_eager_sharding(False):
        model = nnx.bridge.ToNNX(EncoderBlock(cfg), rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(model, x, VALID)
    y = model(x, VALID)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert set(params) == {"attn_norm", "self_attn", "ffn_norm", "ffn"}
    np.testing.assert_array_equal(np.asarray(y), np.asarray(_apply(cfg, params, x)))


def test_bad_valid_tokens_fail_at_trace_time():
    cfg = _cfg()
    params, x = _params(cfg), _x()
    fn = jax.jit(lambda p, a, v: _apply(cfg, p, a, v))
    with pytest.raises(TypeError, match="valid_tokens must be bool"):
        fn(params, x, VALID.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"valid_tokens has shape \(2, 5, 1\)"):
        fn(params, x, VALID[..., None])
    with pytest.raises(AssertionError):
        fn(params, x[..., :4], VALID)  # width 4 is not model_dim


# --- the wiring description is what the block computes ---------------------------------------------


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_wiring_description_is_what_the_block_computes(placement, norm_type):
    """Order: the block records its sites in the wiring's order (seen at each `_record` call).
    Dataflow: replaying the wiring in float64 from the block input and the recorded branches, with
    each norm site's own instance, reproduces every recorded value and the output."""
    cfg = _cfg(norm=placement, norm_type=norm_type)
    wiring = WIRINGS[placement]
    params, x = _params(cfg), _x()
    order = []

    def seen(next_fun, args, kwargs, ctx):
        if isinstance(ctx.module, EncoderBlock) and ctx.method_name == "_record":
            order.append(args[0])
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(seen):
        y, rec = _intermediates(cfg, params, x)
    assert tuple(order) == wiring.order == RECORDED_SITES[placement]
    real = np.asarray(VALID)
    replay = wiring.replay(
        np.asarray(x, np.float64)[real],
        {s.name: np.asarray(rec[s.name], np.float64)[real] for s in wiring.sites if s.kind in ("attention", "FFN")},
        lambda value, module: reference_norm(value, params[module], cfg),
    )
    for site in wiring.sites:
        np.testing.assert_allclose(rec[site.name][real], replay[site.name], rtol=1e-5, atol=1e-5, err_msg=site.name)
    np.testing.assert_allclose(y[real], replay[wiring.output], rtol=1e-5, atol=1e-5)
    assert BLOCK_INPUT not in wiring.order and wiring.output_is_normalized == (placement == "post")


def test_applying_reads_stored_params_and_still_refuses_a_wrong_shape():
    """The stored values are what the block computes with, and a stored parameter of the wrong shape is named."""
    cfg = _cfg()
    params = _params(cfg)
    doubled = jax.tree.map(lambda a: a, params)
    doubled["ffn"]["linear2"]["kernel"] = 2.0 * params["ffn"]["linear2"]["kernel"]
    assert not np.allclose(np.asarray(_apply(cfg, params, _x())), np.asarray(_apply(cfg, doubled, _x())))
    for module, name in (("ffn/linear1", "kernel"), ("ffn_norm", "scale")):
        broken = jax.tree.map(lambda a: a, params)
        holder = functools.reduce(dict.__getitem__, module.split("/"), broken)
        leaf = holder[name]
        holder[name] = jnp.zeros((*leaf.shape[:-1], leaf.shape[-1] + 1), leaf.dtype)
        with pytest.raises(flax.errors.ScopeParamShapeError, match=name):
            _apply(cfg, broken, _x())


class _Counted(nn.Module):
    """A model whose init counts its own traces; `widths` may be made unhashable (a list)."""

    width: int
    widths: object = ()
    calls: ClassVar[list[int]] = []

    @nn.compact
    def __call__(self, tokens: jax.Array, valid: jax.Array) -> jax.Array:
        _Counted.calls.append(self.width)
        return nn.Dense(self.width)(tokens[..., None].astype(jnp.float32))


def test_abstract_params_traces_an_equal_model_once_and_hands_out_copies():
    """jaxblock.initializers.abstract_params keeps one abstract init per (model, length): an equal model
    built anew reuses it, a different one or another length is traced, an unhashable one every call, and
    each caller's tree is its own."""
    _Counted.calls.clear()
    first = abstract_params(_Counted(3))
    assert jax.tree.map(lambda s: (s.shape, s.dtype), nn.unbox(first)) == {
        "Dense_0": {"kernel": ((1, 3), jnp.float32), "bias": ((3,), jnp.float32)}}
    first["Dense_0"] = "scribbled on"
    again = abstract_params(_Counted(3))
    assert _Counted.calls == [3] and nn.unbox(again)["Dense_0"]["kernel"].shape == (1, 3)
    abstract_params(_Counted(4))
    abstract_params(_Counted(3), length=5)
    assert _Counted.calls == [3, 4, 3]
    abstract_params(_Counted(2, widths=[1]))
    abstract_params(_Counted(2, widths=[1]))
    assert _Counted.calls == [3, 4, 3, 2, 2]
