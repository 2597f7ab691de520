"""SelfAttention: against a NumPy reference in every implementation (xla, unfused, chunked), masks, GQA,
fully masked rows, recorded weights, dropout, parameter counts, init, kernel choice and input checks.

Shapes: N=2, L=5, D=8 unless a test says otherwise; H heads of K = D / H, G key/value heads.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import BlockConfig, SelfAttention, choose_implementation, unbox
from jaxblock.positions import apply_rope

IMPLS = ("xla", "unfused", "chunked", "dense")
N, L, D = 2, 5, 8
VALID = np.array([[True, True, True, False, False], [True] * L])


def _cfg(**kw) -> BlockConfig:
    attention = {"chunk_size": 2, **kw.pop("attention", {})}  # chunk 2 at L=5: 3 chunks, padded
    return BlockConfig(**{"model_dim": D, "num_heads": 2, "ffn_dim": 16, **kw, "attention": attention})


def _shapes(cfg: BlockConfig) -> dict:
    x = jax.ShapeDtypeStruct((N, L, cfg.model_dim), jnp.float32)
    v = jax.ShapeDtypeStruct((N, L), jnp.bool_)
    return jax.eval_shape(lambda a, b: unbox(SelfAttention(cfg).init(jax.random.key(0), a, b)), x, v)["params"]


def _params(cfg: BlockConfig, seed: int = 0) -> dict:
    """Host-drawn random parameters (cheap; non-zero biases so every bias is exercised)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), _shapes(cfg))


def _x(seed: int = 1, length: int = L) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(N, length, D)), jnp.float32)


def _run(cfg, params, x, valid, impl, **kw) -> np.ndarray:
    mod = SelfAttention(cfg.with_kernel(impl))
    return np.asarray(mod.apply({"params": params}, x, jnp.asarray(valid), **kw))


def _reference(cfg, p, x, valid, *, attn_mask=None, segment_ids=None) -> np.ndarray:
    """Textbook attention in float64 NumPy; a query with no visible key gets a zero context."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64)
    n, length, _ = x.shape
    h, g, k = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    q = np.einsum("nld,dhk->nlhk", x, p["query"]["kernel"]) + p["query"]["bias"]
    kk = np.einsum("nld,dgk->nlgk", x, p["key"]["kernel"]) + p["key"]["bias"]
    vv = np.einsum("nld,dgk->nlgk", x, p["value"]["kernel"]) + p["value"]["bias"]
    if cfg.attention.rope:
        pos = jnp.broadcast_to(jnp.arange(length), (n, length))
        q = np.asarray(apply_rope(jnp.asarray(q, jnp.float32), pos), np.float64)
        kk = np.asarray(apply_rope(jnp.asarray(kk, jnp.float32), pos), np.float64)
    group = np.arange(h) // (h // g)  # query head -> its key/value head
    kk, vv = kk[:, :, group], vv[:, :, group]  # [N, L, H, K]
    s = np.einsum("nqhk,nmhk->nhqm", q, kk) / math.sqrt(k)
    mask = np.broadcast_to(np.asarray(valid)[:, None, :], (n, length, length))  # [N, Q, M]
    if cfg.attention.causal:
        mask = mask & np.tril(np.ones((length, length), bool))[None]
    if attn_mask is not None:
        mask = mask & (attn_mask[None] if attn_mask.ndim == 2 else attn_mask)
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    s = np.where(mask[:, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    w = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    ctx = np.einsum("nhqm,nmhk->nqhk", w, vv)
    return np.einsum("nqhk,hkd->nqd", ctx, p["out"]["kernel"]) + p["out"]["bias"]


CASES = {
    "causal": ({"attention": {"causal": True}}, {}),
    "attn_mask_2d": ({}, {"attn_mask": np.random.default_rng(0).random((L, L)) > 0.4}),
    "attn_mask_3d_and_segments": (
        {},
        {
            "attn_mask": np.random.default_rng(1).random((N, L, L)) > 0.3,
            "segment_ids": np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], np.int32),
        },
    ),
    "gqa_causal_segments": (
        {"num_heads": 4, "num_kv_heads": 2, "attention": {"causal": True}},
        {"segment_ids": np.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]], np.int32)},
    ),
    "rope_separate_qkv_matmuls": ({"attention": {"rope": True, "fused_qkv": False}}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_implementation_matches_the_reference(case):
    cfg_kw, call_kw = CASES[case]
    cfg = _cfg(**cfg_kw)
    params = _params(cfg, seed=len(case))
    x = _x()
    ref = _reference(cfg, params, x, VALID, **call_kw)
    jkw = {k: jnp.asarray(v) for k, v in call_kw.items()}
    for impl in IMPLS:
        np.testing.assert_allclose(_run(cfg, params, x, VALID, impl, **jkw), ref, atol=1e-5, err_msg=impl)


def test_single_key_is_value_then_out_projection():
    # One visible key: its softmax weight is 1, so y = (x Wv + bv) Wo + bo.
    cfg = _cfg()
    p = _params(cfg)
    x = _x(length=1)
    v = np.einsum("nld,dgk->nlgk", np.asarray(x), np.asarray(p["value"]["kernel"])) + np.asarray(p["value"]["bias"])
    ref = np.einsum("nlhk,hkd->nld", v, np.asarray(p["out"]["kernel"])) + np.asarray(p["out"]["bias"])
    for impl in IMPLS:
        np.testing.assert_allclose(_run(cfg, p, x, np.ones((N, 1), bool), impl), ref, atol=1e-5, err_msg=impl)


def test_padded_keys_never_reach_real_queries():
    cfg = _cfg()
    params = _params(cfg)
    x = _x()
    noisy = x.at[0, 3:].set(100.0 * _x(9)[0, :2])  # row 0 pads at 3, 4
    for impl in IMPLS:
        a, b = _run(cfg, params, x, VALID, impl), _run(cfg, params, noisy, VALID, impl)
        np.testing.assert_allclose(b[0, :3], a[0, :3], atol=1e-6, err_msg=impl)
        np.testing.assert_array_equal(b[1], a[1])
        # Without the key mask the padded keys are attended to and the real queries move.
        c, d = (_run(cfg, params, z, np.ones((N, L), bool), impl) for z in (x, noisy))
        assert np.abs(d[0, :3] - c[0, :3]).max() > 1e-2, impl


def test_fully_masked_row_gives_the_out_bias_and_every_path_has_the_same_finite_gradients():
    cfg = _cfg(num_heads=4, num_kv_heads=2, attention=dict(causal=True))
    params = _params(cfg)
    x = _x()
    valid = jnp.asarray(VALID).at[0].set(False)  # row 0 has no real token at all
    seg = jnp.array([[0, 0, 0, 0, 0], [0, 0, 1, 1, 1]], jnp.int32)
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(N, L, D)), jnp.float32)
    grads = {}
    for impl in IMPLS:
        mod = SelfAttention(cfg.with_kernel(impl))
        y = np.asarray(mod.apply({"params": params}, x, valid, segment_ids=seg))
        np.testing.assert_array_equal(y[0], np.broadcast_to(np.asarray(params["out"]["bias"]), (L, D)), impl)
        assert np.all(np.isfinite(y))

        def loss(p, xx, mod=mod):
            return jnp.sum(mod.apply({"params": p}, xx, valid, segment_ids=seg) * weights)

        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)  # one compile beats op-by-op here
        leaves = jax.tree.leaves(grads[impl])
        assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves), impl
        gx = np.asarray(grads[impl][1])
        # Row 0's inputs cannot influence its output (the bias alone), so their gradient is exactly zero.
        np.testing.assert_array_equal(gx[0], np.zeros((L, D)), impl)
        assert np.abs(gx[1]).max() > 0.0
    for impl in ("unfused", "chunked", "dense"):  # every path's backward pass agrees with XLA's
        for a, b in zip(jax.tree.leaves(grads[impl]), jax.tree.leaves(grads["xla"]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_segments_never_see_each_other(impl):
    cfg = _cfg(attention=dict(kernel=impl))
    params = _params(cfg)
    seg = jnp.array([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], jnp.int32)
    x = _x()
    changed = x.at[:, 3:].add(5.0)  # tokens 3, 4 are in segment 1 of both rows
    valid = jnp.ones((N, L), bool)
    a = _run(cfg, params, x, valid, impl, segment_ids=seg)
    b = _run(cfg, params, changed, valid, impl, segment_ids=seg)
    np.testing.assert_allclose(b[1, :3], a[1, :3], atol=1e-6)
    np.testing.assert_allclose(b[0, :2], a[0, :2], atol=1e-6)
    assert np.abs(b[0, 2] - a[0, 2]).max() > 1e-3  # token 2 of row 0 is in segment 1 and does move


def test_unfused_records_attention_weights():
    cfg = _cfg(attention=dict(kernel="unfused", causal=True))
    params = _params(cfg)
    valid = jnp.asarray(VALID).at[0].set(False)
    _, state = SelfAttention(cfg).apply({"params": params}, _x(), valid, mutable=["intermediates"])
    (w,) = state["intermediates"]["attention_weights"]
    w = np.asarray(w)
    assert w.shape == (N, 2, L, L)  # [N, H, L, L]
    np.testing.assert_array_equal(w[0], 0.0)  # no visible key: all-zero weights, not a uniform average
    np.testing.assert_allclose(w[1].sum(-1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(np.triu(w[1], k=1), 0.0)  # causal: nothing above the diagonal


def test_attention_dropout_runs_unfused_differs_by_key_and_is_off_in_eval():
    cfg = _cfg(attention=dict(dropout=0.5, kernel="unfused"))
    assert choose_implementation(cfg, train=True)[0] == "unfused"
    params = {"params": _params(cfg)}
    mod, x, valid = SelfAttention(cfg), _x(), jnp.asarray(VALID)

    def train(seed):
        return np.asarray(mod.apply(params, x, valid, train=True, rngs={"dropout": jax.random.key(seed)}))

    np.testing.assert_array_equal(train(0), train(0))
    assert np.abs(train(0) - train(1)).max() > 1e-3
    eval_out = np.asarray(mod.apply(params, x, valid))
    np.testing.assert_array_equal(eval_out, np.asarray(mod.apply(params, x, valid)))
    np.testing.assert_allclose(eval_out, _run(cfg, params["params"], x, VALID, "xla"), atol=1e-6)


def _count(tree) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


@pytest.mark.parametrize("d,h,g", [(8, 2, None), (16, 4, 2), (16, 4, 1)])
def test_parameter_counts(d, h, g):
    cfg = BlockConfig(model_dim=d, num_heads=h, num_kv_heads=g, ffn_dim=4 * d, use_bias=False)
    k, kv = d // h, g or h
    n = _count(_shapes(cfg))
    assert n == d * h * k + 2 * d * kv * k + h * k * d
    if g is None:
        assert n == 4 * d * d
    shapes = _shapes(cfg)
    assert shapes["query"]["kernel"].shape == (d, h, k) and shapes["key"]["kernel"].shape == (d, kv, k)
    assert shapes["out"]["kernel"].shape == (h, k, d)


def test_torch_init_distributions():
    d = 64
    cfg = BlockConfig(model_dim=d, num_heads=4, ffn_dim=4 * d, init="torch")
    x = jnp.ones((1, 1, d))
    p = unbox(jax.jit(SelfAttention(cfg).init)(jax.random.key(3), x, jnp.ones((1, 1), bool)))["params"]
    xavier = math.sqrt(6.0 / (4 * d))  # in_proj_weight is one Xavier-uniform [3D, D] matrix
    for name in ("query", "key", "value"):
        kern = np.asarray(p[name]["kernel"])
        assert xavier * 0.9 < np.abs(kern).max() <= xavier
        np.testing.assert_allclose(kern.std(), xavier / math.sqrt(3.0), rtol=0.06)
        np.testing.assert_array_equal(np.asarray(p[name]["bias"]), 0.0)  # in_proj_bias is zero
    out = np.asarray(p["out"]["kernel"])
    assert 0.9 / math.sqrt(d) < np.abs(out).max() <= 1.0 / math.sqrt(d)  # nn.Linear default
    np.testing.assert_array_equal(np.asarray(p["out"]["bias"]), 0.0)  # MultiheadAttention zeroes it


def test_choose_implementation_states_its_reason():
    cfg = _cfg()
    impl, why = choose_implementation(cfg, train=False, backend="cpu")
    assert impl == "dense" and why.startswith("backend is cpu, not an NVIDIA GPU") and "dense kernel" in why
    # Long L on a CPU: chunked from 4 key blocks on (measured faster there, memory linear in L).
    long = _cfg(attention=dict(chunk_size=16))
    assert choose_implementation(long, train=False, backend="cpu", length=63)[0] == "dense"
    impl, why = choose_implementation(long, train=False, backend="cpu", length=64)
    assert impl == "chunked" and "L=64" in why
    bf16 = _cfg(dtype="bfloat16", num_heads=1)  # head width 8: what cuDNN's kernel accepts
    assert choose_implementation(bf16, train=False, backend="gpu")[0] == "cudnn"
    impl, why = choose_implementation(bf16, train=False, backend="gpu", extra_mask=True)
    assert impl == "xla" and "segment_ids" in why
    impl, why = choose_implementation(cfg, train=False, backend="gpu")
    assert impl == "xla" and "float32" in why
    impl, why = choose_implementation(bf16.model_copy(update={"num_heads": 4}), train=False, backend="gpu")
    assert impl == "xla" and "head width 2" in why
    assert choose_implementation(_cfg(attention=dict(dropout=0.1)), train=False, backend="cpu")[0] == "dense"
    impl, why = choose_implementation(_cfg(attention=dict(dropout=0.1)), train=True, backend="cpu")
    assert impl == "dense" and "dropout" in why  # the dense kernel applies dropout itself
    impl, why = choose_implementation(_cfg(attention=dict(dropout=0.1)), train=True, backend="gpu")
    assert impl == "unfused" and "dropout" in why
    dense, xla = _cfg(attention=dict(kernel="dense", dropout=0.1)), _cfg(attention=dict(kernel="xla", dropout=0.1))
    assert choose_implementation(dense, train=True, backend="gpu")[0] == "dense"
    assert choose_implementation(xla, train=True, backend="cpu")[0] == "unfused"
    impl, why = choose_implementation(_cfg(attention=dict(kernel="chunked", dropout=0.1)), train=True)
    assert impl == "unfused" and "dropout" in why
    assert choose_implementation(_cfg(attention=dict(kernel="chunked", dropout=0.1)), train=False)[0] == "chunked"
    impl, why = choose_implementation(_cfg(attention=dict(kernel="cudnn")), train=False, backend="cpu")
    assert impl == "xla" and "cuDNN requested" in why


def test_accelerator_rules_pick_by_target_platform_with_reasons():
    from jaxblock.attention.dispatch import layer_kernels
    from jaxblock.attention.platform import for_platform, platform_name
    from jaxblock.config import StackConfig

    cfg, bf16 = _cfg(), _cfg(dtype="bfloat16", num_heads=1)
    impl, why = choose_implementation(cfg, train=False, backend="tpu", segments=True, window=True)
    assert impl == "splash" and "segment ids" in why
    impl, why = choose_implementation(cfg, train=False, backend="tpu", attn_mask=True)
    assert impl == "xla" and "attn_mask" in why
    impl, why = choose_implementation(_cfg(attention=dict(dropout=0.1)), train=True, backend="tpu")
    assert impl == "unfused" and "attention.dropout=0" in why  # the reason names the fix
    assert choose_implementation(_cfg(attention=dict(dropout=0.1)), train=False, backend="tpu")[0] == "splash"
    # GPU: cuDNN for plain masks in half precision, the Pallas kernel for packed rows, XLA for windows.
    assert choose_implementation(bf16, train=False, backend="cuda")[0] == "cudnn"
    impl, why = choose_implementation(bf16, train=False, backend="gpu", segments=True)
    assert impl == "pallas_gpu" and "segment ids" in why
    assert choose_implementation(cfg, train=False, backend="gpu", segments=True)[0] == "pallas_gpu"
    assert choose_implementation(bf16, train=False, backend="gpu", segments=True, window=True)[0] == "xla"
    # Requested off their platform: interpret mode, said so; a mask they cannot take: XLA, said so.
    impl, why = choose_implementation(_cfg(attention=dict(kernel="splash")), train=False, backend="cpu")
    assert impl == "splash" and "interpret" in why
    pallas = _cfg(attention=dict(kernel="pallas_gpu"))
    impl, why = choose_implementation(pallas, train=False, backend="gpu", window=True)
    assert impl == "xla" and "window" in why
    # The platform being lowered for decides, not the backend tracing: a CPU host tracing for a TPU.
    with for_platform("tpu"):
        assert choose_implementation(cfg, train=False)[0] == "splash"
    assert choose_implementation(cfg, train=False)[0] == "dense"
    with pytest.raises(ValueError, match="unknown platform 'rocmx'"):
        platform_name("rocmx")
    # Per layer: a global layer among windowed ones has no window unless the stack is scanned.
    stack = StackConfig(num_layers=2, block=dict(model_dim=D, num_heads=2, ffn_dim=16), layers=dict(window=(None, 4)))
    assert [k for k, _ in layer_kernels(stack, train=False, length=8, segments=True, backend="gpu")] == [
        "pallas_gpu", "xla"]
    scanned = stack.model_copy(update={"scan_layers": True})
    assert [k for k, _ in layer_kernels(scanned, train=False, length=8, segments=True, backend="gpu")] == [
        "xla", "xla"]


def test_bad_masks_are_clear_errors_at_trace_time():
    cfg = _cfg()
    params = {"params": _params(cfg)}
    mod, x = SelfAttention(cfg), _x()
    with pytest.raises(TypeError, match="valid_tokens must be bool"):
        jax.jit(mod.apply)(params, x, jnp.ones((N, L), jnp.int32))
    with pytest.raises(ValueError, match=r"valid_tokens has shape \(2, 4\)"):
        jax.jit(mod.apply)(params, x, jnp.ones((N, L - 1), bool))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        mod.apply(params, x, jnp.ones((N, L), bool), attn_mask=jnp.zeros((L, L)))


def test_the_dense_kernel_drops_exactly_the_weights_the_unfused_path_drops():
    # Same rng stream and mask shape: outputs and every gradient agree, with GQA, causal and a row with no key.
    cfg = _cfg(num_heads=4, num_kv_heads=2, attention=dict(dropout=0.3, causal=True))
    params = _params(cfg)
    x = _x()
    valid = jnp.asarray(VALID).at[0].set(False)
    weights = jnp.asarray(np.random.default_rng(5).normal(size=(N, L, D)), jnp.float32)
    outs, grads = {}, {}
    for impl in ("unfused", "dense"):
        mod = SelfAttention(cfg.with_kernel(impl))
        rngs = {"dropout": jax.random.key(7)}

        def loss(p, xx, mod=mod, rngs=rngs):
            return jnp.sum(mod.apply({"params": p}, xx, valid, train=True, rngs=rngs) * weights)

        outs[impl] = np.asarray(mod.apply({"params": params}, x, valid, train=True, rngs=rngs))
        grads[impl] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(outs["dense"], outs["unfused"], atol=1e-5)
    np.testing.assert_array_equal(outs["dense"][0], np.broadcast_to(np.asarray(params["out"]["bias"]), (L, D)))
    for a, b in zip(jax.tree.leaves(grads["dense"]), jax.tree.leaves(grads["unfused"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # and dropout did act: the eval output differs
    dense = SelfAttention(cfg.with_kernel("dense"))
    eval_out = np.asarray(dense.apply({"params": params}, x, valid))
    assert np.abs(eval_out - outs["dense"]).max() > 1e-3
