"""The accelerator attention kernels (splash on TPU, JAX's Pallas GPU kernel) hold the package's contract,
checked on this CPU in Pallas interpret mode: the same function as the dense kernel, forward and gradients.

- Property-based (hypothesis) over padding patterns (rows with no real token included), packing, causal,
  windows, GQA ratios and lengths that are not a multiple of the kernel's 128-row block: float32 to 2e-5
  (outputs and the gradients of q, k, v), bfloat16 inputs to 4e-2 of the float32 dense result.
- The Pallas GPU kernel differs only at padded queries, which it sets to 0 (its one segment-id array cannot
  give a padded query its segment's keys while hiding padded keys): it is compared on real positions, and
  its gradients through a loss on real positions (which is what a padded position reaches) are equal.
- A packed batch's per-segment outputs equal each segment run alone, on every kernel (a kernel that ignored
  segment ids would let packed examples attend across their boundaries, and fail here).
- The whole encoder, scanned and unrolled, with per-layer windows: splash equals the dense kernel.

Interpret mode runs the kernels' Python per block: the default suite keeps a few small examples, the
grid (more examples, several key blocks), the whole-encoder cases and the packed-segment cases of the CPU
kernels are marked slow.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxblock import Encoder, EncoderConfig, masks, unbox
from jaxblock.attention import dense_attention
from jaxblock.attention.gpu import pallas_gpu_attention
from jaxblock.attention.splash import block_size, padded_length, splash_attention

F32_TOL = 2e-5
BF16_TOL = 4e-2


def _dense(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, causal: bool, seg: Any, window: Any) -> Any:
    m = masks.attention_mask(valid, causal=causal, segment_ids=seg,
                             window=None if window is None else jnp.asarray(window))
    return dense_attention(q, k, v, m, jnp.any(m[:, 0], axis=-1))


def _case(draw: Any, max_len: int, fixed: bool = False) -> dict[str, Any]:
    """fixed: one shape (N=2, L=max_len, G=2, R=2) and a few mask kinds, so the fast cases compile little."""
    n = 2 if fixed else draw(st.integers(1, 2))
    length = max_len if fixed else draw(st.integers(3, max_len))
    g = 2 if fixed else draw(st.sampled_from([1, 2]))
    r = 2 if fixed else draw(st.sampled_from([1, 2, 4]))
    # Lengths per row: 0 (a row with no real token: every query sees no key), partial, full.
    lengths = draw(st.lists(st.integers(0, length), min_size=n, max_size=n))
    packed = draw(st.booleans())
    cuts = sorted(draw(st.lists(st.integers(1, length - 1), max_size=3))) if packed else []
    window = draw(st.sampled_from([None, 3]) if fixed else st.one_of(st.none(), st.integers(0, 6)))
    causal = draw(st.just(False) if fixed and window is not None else st.booleans())
    return dict(n=n, length=length, g=g, h=g * r, lengths=lengths, cuts=cuts, window=window,
                causal=causal, seed=draw(st.integers(0, 2**16)))


def _arrays(c: dict[str, Any], dtype: Any = jnp.float32) -> tuple[Any, ...]:
    rng = np.random.default_rng(c["seed"])
    n, length, h, g, kdim = c["n"], c["length"], c["h"], c["g"], 8
    q = jnp.asarray(rng.normal(size=(n, length, h, kdim)), dtype)
    k = jnp.asarray(rng.normal(size=(n, length, g, kdim)), dtype)
    v = jnp.asarray(rng.normal(size=(n, length, g, kdim)), dtype)
    valid = jnp.arange(length)[None, :] < jnp.asarray(c["lengths"])[:, None]
    v = jnp.where(valid[:, :, None, None], v, 0)  # as SelfAttention hands values to every kernel
    seg = None
    if c["cuts"]:
        seg = jnp.broadcast_to(jnp.searchsorted(jnp.asarray(c["cuts"]), jnp.arange(length), side="right"),
                               (n, length)).astype(jnp.int32)
    return q, k, v, valid, seg


def _compare(
    kernel: Any, c: dict[str, Any], *, real_only: bool, dtype: Any = jnp.float32, tol: float = F32_TOL
) -> None:
    q, k, v, valid, seg = _arrays(c, dtype)
    out, want, unseen, got, exp = _run(kernel, c["causal"], c["window"], real_only, q, k, v, valid, seg)
    where = valid[:, :, None, None] if real_only else jnp.ones_like(valid)[:, :, None, None]
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(np.where(where, out, 0), np.where(where, want, 0), atol=tol, rtol=0)
    if not real_only:  # a query that sees no key gets exactly 0
        assert float(jnp.abs(jnp.where(unseen[:, :, None, None], out, 0)).max(initial=0.0)) == 0.0
    for name, a, b in zip("qkv", got, exp, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), f"d{name} not finite"
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=tol * 4, rtol=0, err_msg=f"d{name}")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _run(kernel: Any, causal: bool, window: int | None, real_only: bool, q: Any, k: Any, v: Any, valid: Any,
         seg: Any) -> tuple[Any, ...]:
    """Both kernels' outputs and gradients of q, k, v (the reference in float32), compiled once per mask kind."""
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    where = valid[:, :, None, None] if real_only else jnp.ones_like(valid)[:, :, None, None]

    def loss(fn: Any, q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(jnp.where(where, fn(q, k, v).astype(jnp.float32) * weights, 0.0))

    def ours(q: Any, k: Any, v: Any) -> Any:
        return kernel(q, k, v, valid, causal=causal, segment_ids=seg, window=window)

    def ref(q: Any, k: Any, v: Any) -> Any:
        return _dense(q, k, v, valid, causal, seg, window)

    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    m = masks.attention_mask(valid, causal=causal, segment_ids=seg,
                             window=None if window is None else jnp.asarray(window))
    got = jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2))(q, k, v)
    exp = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(*f32)
    return ours(q, k, v).astype(jnp.float32), ref(*f32), ~jnp.any(m[:, 0], axis=-1), got, exp


def _splash(q: Any, k: Any, v: Any, valid: Any, **kw: Any) -> Any:
    return splash_attention(q, k, v, valid, interpret=True, **kw)


def _pallas_gpu(q: Any, k: Any, v: Any, valid: Any, *, window: Any, **kw: Any) -> Any:
    assert window is None  # the dispatch never sends a window to this kernel
    return pallas_gpu_attention(q, k, v, valid, interpret=True, **kw)


FAST = settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
GRID = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@FAST
@given(st.data())
def test_splash_equals_dense_kernel(data: Any) -> None:
    _compare(_splash, _case(data.draw, 37, fixed=True), real_only=False)


@FAST
@given(st.data())
def test_pallas_gpu_equals_dense_kernel_on_real_positions(data: Any) -> None:
    _compare(_pallas_gpu, _case(data.draw, 37, fixed=True) | {"window": None}, real_only=True)


@pytest.mark.slow
@GRID
@given(st.data())
def test_splash_equals_dense_kernel_grid(data: Any) -> None:
    _compare(_splash, _case(data.draw, 300), real_only=False)


@pytest.mark.slow
@GRID
@given(st.data())
def test_pallas_gpu_equals_dense_kernel_grid(data: Any) -> None:
    _compare(_pallas_gpu, _case(data.draw, 300) | {"window": None}, real_only=True)


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu"])
def test_bfloat16_inputs_stay_within_the_stated_tolerance(kernel: str) -> None:
    c = dict(n=2, length=37, g=1, h=2, lengths=[37, 20], cuts=[11], window=None, causal=True, seed=3)
    _compare(_splash if kernel == "splash" else _pallas_gpu, c, real_only=kernel != "splash",
             dtype=jnp.bfloat16, tol=BF16_TOL)


def test_block_sizes_pad_to_the_lane_width() -> None:
    assert [padded_length(n) for n in (1, 128, 129, 300)] == [128, 128, 256, 384]
    assert [block_size(n) for n in (100, 256, 300, 512, 640, 1024)] == [128, 256, 128, 512, 128, 512]


def _barrier_operands(jaxpr: Any) -> list[list[Any]]:
    """The operand avals of every optimization_barrier in a jaxpr and the jaxprs it calls."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "optimization_barrier":
            found.append([v.aval for v in eqn.invars])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _barrier_operands(sub)
    return found


def test_splash_forward_makes_its_backwards_residuals_next_to_the_kernel() -> None:
    """The forward passes the kernel's output only together with what splash's backward reads: the float32
    log-sum-exp per query [.., Lp], never the kernel's lane-wide [.., Lp, 128] form (which XLA kept from the
    forward to the backward in every layer of a TPU FSDP step); and jax.vjp's backward is a pytree of those
    arrays (the splash wrapper hands it to custom_vjp as its residuals: an upgrade that changes this fails here)."""
    n, length, h, kdim = 2, 128, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (n, length, h, kdim)) for i in range(3))
    valid = jnp.arange(length)[None, :] < jnp.array([[100], [128]])
    attend = functools.partial(splash_attention, valid_tokens=valid, causal=False)
    jaxpr = jax.make_jaxpr(lambda q, k, v: jax.vjp(attend, q, k, v)[1])(q, k, v)
    barriers = _barrier_operands(jaxpr.jaxpr)
    assert barriers, "no optimization barrier in splash's forward"
    shapes = [(a.shape, a.dtype) for ops in barriers for a in ops]
    assert any(shape[-1:] == (length,) and dtype == jnp.float32 for shape, dtype in shapes)  # the log-sum-exp
    assert any(shape[-2:] == (length, kdim) for shape, _ in shapes)  # the output, released with it
    assert not any(shape[-2:] == (length, 128) for shape, _ in shapes)
    _, backward = jax.vjp(jnp.sin, jnp.ones(3))
    assert [leaf.shape for leaf in jax.tree.leaves(backward)] == [(3,)]


def test_splash_keeps_narrow_heads_lane_dense_for_its_backward() -> None:
    """q, k, v and the output with a head width under the TPU's 128 lanes (BERT's 64) go from the forward to the
    backward as [.., Lp * K / 128, 128] copies, not in the kernel's [.., Lp, K] layout (twice their bytes on a
    TPU); the gradients are splash's own (tests above: equal to the dense kernel's)."""
    n, length, h, kdim = 2, 128, 2, 64
    q, k, v = (jax.random.normal(jax.random.key(i), (n, length, h, kdim)) for i in range(3))
    valid = jnp.arange(length)[None, :] < jnp.array([[100], [128]])
    attend = functools.partial(splash_attention, valid_tokens=valid, causal=False)
    kept = [leaf.shape for leaf in jax.tree.leaves(jax.vjp(attend, q, k, v)[1])]
    dense = [shape for shape in kept if shape[-2:] == (length * kdim // 128, 128)]
    assert len(dense) == 4, kept  # q, k, v and the output
    assert not any(shape[-2:] == (length, kdim) for shape in kept), kept


# --- through the model ---------------------------------------------------------------------------------

V, L = 40, 24
KERNELS = ["dense", "chunked", "xla", "unfused", "splash", "pallas_gpu"]


def _encoder(attention: str, **extra: Any) -> tuple[Encoder, Any]:
    """The model with this kernel, and the parameters (the same tree for every kernel) of the dense one."""
    return _model(attention, **extra), _params(tuple(sorted(extra.items())))


def _model(attention: str, *, window: tuple[int | None, ...] | None = None, **extra: Any) -> Encoder:
    fields: dict[str, Any] = dict(num_layers=2, vocab_size=V, max_len=L, layers=dict(window=window)) | extra
    return Encoder(EncoderConfig(**fields, block=dict(model_dim=16, num_heads=4, num_kv_heads=2, ffn_dim=32,
                                                      attention=dict(kernel=attention, chunk_size=8))))


@functools.cache
def _params(extra: tuple[tuple[str, Any], ...]) -> Any:
    """Initialised once per stack layout, in one compiled program (op by op compiles every init operation)."""
    tokens = jnp.ones((1, L), jnp.int32)
    return unbox(jax.jit(_model("dense", **dict(extra)).init)(jax.random.key(0), tokens, tokens > 0))["params"]


# The CPU kernels' segment handling is checked in the default suite by tests/jaxblock/attention/test_module.py
# (test_segments_never_see_each_other and the segment cases of test_every_implementation_matches_the_reference,
# every CPU kernel) and through whole models by the packed-row tests of tests/jaxblock/test_model.py and
# tests/jaxblock/attention/test_per_layer.py: here, where they would only add compiles, they run under -m slow.
@pytest.mark.parametrize("attention", [k if k in ("splash", "pallas_gpu") else pytest.param(k, marks=pytest.mark.slow)
                                       for k in KERNELS])
def test_packed_segments_equal_each_segment_alone(attention: str) -> None:
    """Two examples packed in one row, then padding: each segment's outputs equal that example run alone."""
    model, params = _encoder(attention)
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, V, 9), rng.integers(1, V, 7)
    packed = np.zeros((1, L), np.int32)
    packed[0, :9], packed[0, 9:16] = a, b
    seg = np.zeros((1, L), np.int32)
    seg[0, 9:] = 1
    seg[0, 16:] = 2  # the padding of a packed row
    valid = jnp.arange(L)[None] < 16
    apply = jax.jit(model.apply)
    out = apply({"params": params}, jnp.asarray(packed), valid, segment_ids=jnp.asarray(seg))
    for tokens, start in ((a, 0), (b, 9)):
        alone = np.zeros((1, L), np.int32)
        alone[0, : len(tokens)] = tokens
        ref = apply({"params": params}, jnp.asarray(alone), jnp.arange(L)[None] < len(tokens))
        np.testing.assert_allclose(out[0, start: start + len(tokens)], ref[0, : len(tokens)], atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(("kernel", "scan"), [("splash", False), ("splash", True), ("pallas_gpu", True)])
def test_encoder_equals_dense_through_the_whole_model(kernel: str, scan: bool) -> None:
    """GQA, packing and a row with no real token through a whole encoder, outputs and every parameter's
    gradient. Splash also with windows (one global layer): a scanned stack hands each layer its window
    traced, and splash picks among the stack's static windows. (The Pallas GPU kernel takes no window.)"""
    extra: dict[str, Any] = dict(num_layers=2, scan_layers=scan)
    if kernel == "splash":
        extra["window"] = (None, 3)
    (model, params), (dense_model, _) = _encoder(kernel, **extra), _encoder("dense", **extra)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, V, (2, L)), jnp.int32)
    valid = jnp.arange(L)[None] < jnp.asarray([[20], [0]])
    seg = (jnp.arange(L)[None] >= 8).astype(jnp.int32).repeat(2, axis=0)

    def loss(m: Any, p: Any) -> Any:
        y = m.apply({"params": p}, tokens, valid, segment_ids=seg)
        return jnp.sum(jnp.sin(y) * valid[..., None]), y

    (_, y1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(model, p), has_aux=True))(params)
    (_, y2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(dense_model, p), has_aux=True))(params)
    real = np.asarray(valid)[..., None]
    np.testing.assert_allclose(np.where(real, y1, 0), np.where(real, y2, 0), atol=F32_TOL, rtol=0)
    if kernel == "splash":  # equal at padded positions too
        np.testing.assert_allclose(y1, y2, atol=F32_TOL, rtol=0)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["splash", "pallas_gpu"])
def test_kernels_run_per_shard_of_the_ambient_mesh(kernel: str) -> None:
    """Under a (data 2, fsdp 2, tensor 2) mesh with the trainer's rules, the kernel runs inside shard_map
    (rows over data x fsdp, heads over tensor) and gives the unsharded result, forward and gradients."""
    import flax.linen as nn
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    rules = [("batch", ("data", "fsdp")), ("heads", "tensor"), ("kv_heads", "tensor")]
    c = dict(n=4, length=37, g=2, h=4, lengths=[37, 20, 0, 5], cuts=[11], window=None, causal=True, seed=5)
    q, k, v, valid, seg = _arrays(c)
    fn = _splash if kernel == "splash" else _pallas_gpu

    def loss(q: Any, k: Any, v: Any) -> Any:
        out = fn(q, k, v, valid, causal=True, segment_ids=seg, window=None)
        return jnp.sum(jnp.where(valid[:, :, None, None], out, 0.0) ** 2), out

    def sharded(q: Any, k: Any, v: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
            return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    spec = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor", None))
    placed = [jax.device_put(a, spec) for a in (q, k, v)]
    lowered = jax.jit(sharded).lower(*placed).as_text()
    assert "shard_map" in lowered or "sdy.manual_computation" in lowered  # the kernel ran per shard
    (_, out), grads = jax.jit(sharded)(*placed)
    (_, want), want_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(out, want, atol=1e-6, rtol=0)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_pallas_gpu_output_is_exactly_zero_at_padded_queries_whatever_they_held() -> None:
    """No mask after the kernel: a padded query's q and k are cleared before it, so its output is exactly 0 even
    when the padded positions held NaN or Inf (a row of padding only included), and real rows are the dense
    kernel's."""
    n, length, h, kdim = 3, 37, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(n, length, h, kdim)), jnp.float32) for _ in range(3))
    valid = jnp.arange(length)[None, :] < jnp.asarray([20, 37, 0])[:, None]
    pad = ~valid[:, :, None, None]
    q, k = jnp.where(pad, jnp.nan, q), jnp.where(pad, jnp.inf, k)
    v = jnp.where(pad, 0.0, v)  # as SelfAttention hands values to every kernel
    out = jax.jit(lambda q, k, v: pallas_gpu_attention(q, k, v, valid, causal=False, interpret=True))(q, k, v)
    assert bool(jnp.all(jnp.where(pad, out, 0.0) == 0.0)) and bool(jnp.all(jnp.isfinite(out)))
    want = _dense(jnp.where(pad, 0.0, q), jnp.where(pad, 0.0, k), v, valid, False, None, None)
    np.testing.assert_allclose(np.where(pad, 0.0, out), np.where(pad, 0.0, want), atol=F32_TOL, rtol=0)
