"""Non-finite or out-of-range values at padded positions never reach parameter gradients.

Padded positions may hold anything (docs/model.md, the mask convention). The forward pass already keeps them out of
real outputs; these tests check the backward pass too: with NaN or +-Inf values in padded rows of x,
or ids outside [0, V) at padded positions, every gradient array is finite and bitwise equal to the
gradients with clean padding, and real outputs are unchanged. Each attention path that runs on a CPU
(`xla`, `unfused`, `chunked`) and packed rows (segment_ids) are covered.

Shapes: N=2 rows, L=8 tokens, D=8, H=2, F=16, B=2 blocks, V=11 ids, C=3 classes, chunk 4 (two key blocks).
Row 0 has 5 real tokens (3 padded), row 1 has 8.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import Classifier, Encoder, EncoderBlock, EncoderConfig, EncoderStack, StackConfig, unbox

N, L, D, V = 2, 8, 8, 11
VALID = jnp.arange(L)[None, :] < jnp.asarray([[5], [8]])  # bool[N, L]
TOKENS = jnp.asarray(np.random.default_rng(0).integers(1, V, (N, L)), jnp.int32)
X = jnp.asarray(np.random.default_rng(1).normal(size=(N, L, D)), jnp.float32)
# Packed: row 0 holds two examples (3 + 2 tokens) then 3 padded, row 1 two examples (5 + 3).
SEGMENTS = jnp.asarray([[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1]], jnp.int32)
IMPLS = ("xla", "unfused", "chunked", "dense")
# Non-finite values only: finite padding is computed as PyTorch's slow path computes it (and must stay
# visible, or the padding-invariance diagnostic could not see a missing key mask), so a finite value large
# enough to overflow inside the block (e.g. 3e38) is the caller's to avoid.
POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
BAD_IDS = {"too_large": V + 88, "negative": -5, "int_max": np.iinfo(np.int32).max}


def _block(impl: str, norm: str = "pre") -> dict:
    return dict(model_dim=D, num_heads=2, ffn_dim=16, attention=dict(kernel=impl, chunk_size=4), norm=norm)


def _variables(module, *args, **kw) -> dict:
    """Host-drawn parameters in the module's tree (norm scales near 1, all else non-zero): an abstract init
    compiles nothing, where an eager one compiles each of its operations."""
    shapes = jax.eval_shape(lambda: unbox(module.init(jax.random.key(0), *args, **kw)))
    rng = np.random.default_rng(0)

    def draw(path, s):
        centre = 1.0 if path[-1].key == "scale" else 0.0
        return jnp.asarray(centre + rng.normal(0.0, 0.4, s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _loss_weights(shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(np.random.default_rng(2).normal(size=shape), jnp.float32)


def _real_loss(out: jax.Array, weights: jax.Array) -> jax.Array:
    # where, not multiply: a padded output is free to be anything the model makes of it.
    keep = VALID[..., None] if out.ndim == 3 and out.shape[1] == L else True
    return jnp.sum(jnp.where(keep, out * weights, 0.0))


def _values_and_grads(module, variables, inputs: list, *rest, **kw) -> list:
    """(output, gradients) for each first input, all in one compiled program (vmapped over the inputs)."""

    def loss(params, first):
        out = module.apply({"params": params}, first, *rest, **kw)
        return _real_loss(out, _loss_weights(out.shape)), out

    grad_fn = jax.vmap(jax.value_and_grad(loss, has_aux=True), in_axes=(None, 0))
    (_, outs), grads = jax.jit(grad_fn)(variables["params"], jnp.stack(inputs))
    outs, grads = np.asarray(outs), jax.tree.map(np.asarray, grads)
    return [(outs[i], jax.tree.map(lambda g, i=i: g[i], grads)) for i in range(len(inputs))]


def _assert_same(clean, dirty) -> None:
    out_clean, g_clean = clean
    out_dirty, g_dirty = dirty
    leaves = jax.tree_util.tree_leaves_with_path(g_dirty)
    bad = [jax.tree_util.keystr(p) for p, g in leaves if not np.all(np.isfinite(g))]
    assert not bad, f"{len(bad)} of {len(leaves)} gradient arrays are not finite: {bad[:3]}"
    for (path, got), want in zip(leaves, jax.tree.leaves(g_clean), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=jax.tree_util.keystr(path))
    if out_clean.ndim == 3 and out_clean.shape[1] == L:  # token outputs: compare real positions only
        np.testing.assert_array_equal(out_dirty[np.asarray(VALID)], out_clean[np.asarray(VALID)])
    else:  # pooled logits
        np.testing.assert_array_equal(out_dirty, out_clean)


def _check(module, variables, clean, dirty: list, *rest, **kw) -> None:
    results = _values_and_grads(module, variables, [clean, *dirty], *rest, **kw)
    for got in results[1:]:
        _assert_same(results[0], got)


def _poisoned_x(value: float) -> jax.Array:
    return jnp.where(VALID[..., None], X, value)


def _slow_unless(*default):
    """Parameters: the cases in `default` run in the default suite, the rest are marked slow."""
    def mark(*values):
        if values in default:
            return values[0] if len(values) == 1 else values
        return pytest.param(*values, marks=pytest.mark.slow)
    return mark


_block_case = _slow_unless(("xla", "pre"), ("dense", "post"))


@pytest.mark.parametrize(("impl", "norm"), [_block_case(i, n) for i in IMPLS for n in ("pre", "post")])
def test_block_gradients_ignore_non_finite_padded_inputs(impl, norm):
    block = EncoderBlock(EncoderConfig(block=_block(impl, norm)).block)
    variables = _variables(block, X, VALID)
    _check(block, variables, X, [_poisoned_x(v) for v in POISONS.values()], VALID)


_packed_case = _slow_unless(("chunked", True))


@pytest.mark.parametrize(("impl", "packed"), [_packed_case(i, p) for i in IMPLS for p in (False, True)])
def test_stack_gradients_ignore_non_finite_padded_inputs(impl, packed):
    stack = EncoderStack(StackConfig(num_layers=2, block=_block(impl)))
    kw = {"segment_ids": SEGMENTS} if packed else {}
    variables = _variables(stack, X, VALID, **kw)
    _check(stack, variables, X, [_poisoned_x(v) for v in POISONS.values()], VALID, **kw)


def _ecfg(impl: str, positions: str = "learned") -> EncoderConfig:
    return EncoderConfig(vocab_size=V, max_len=L, num_layers=2, num_classes=3, block=_block(impl),
                         embedding=dict(positions=positions))


def _bad_ids() -> list:
    return [jnp.where(VALID, TOKENS, bad) for bad in BAD_IDS.values()]


@pytest.mark.parametrize("impl", [_slow_unless()(i) for i in IMPLS])
def test_encoder_gradients_ignore_out_of_range_padded_ids(impl):
    encoder = Encoder(_ecfg(impl))
    variables = _variables(encoder, TOKENS, VALID)
    _check(encoder, variables, TOKENS, _bad_ids(), VALID)


_classifier_case = _slow_unless(("unfused", False))


@pytest.mark.parametrize(("impl", "packed"), [_classifier_case(i, p) for i in IMPLS for p in (False, True)])
def test_classifier_gradients_ignore_out_of_range_padded_ids(impl, packed):
    model = Classifier(_ecfg(impl, positions="sinusoidal"))
    kw = {"segment_ids": SEGMENTS, "num_segments": 2} if packed else {}
    variables = _variables(model, TOKENS, VALID, **kw)
    results = _values_and_grads(model, variables, [TOKENS, *_bad_ids()], VALID, **kw)  # one program
    clean_grads = results[0][1]
    # The clean gradients are not trivially zero: all but at most one array (an unused id row) move.
    assert sum(np.abs(g).max() > 0 for g in jax.tree.leaves(clean_grads)) >= len(jax.tree.leaves(clean_grads)) - 1
    for got in results[1:]:
        _assert_same(results[0], got)


def test_finite_padding_clears_a_padded_token_whole() -> None:
    """A padded token with any non-finite value becomes 0 in all D values; a finite padded token and every real
    one pass unchanged, and so do their gradients. (Per token, so that the backward reads a bool [N, L] and not
    x: docs/accelerators.md, "What a layer keeps for its backward".)"""
    from jaxblock.block import _finite_padding

    x = X.at[0, 6, 3].set(jnp.nan).at[0, 7, 0].set(jnp.inf)  # row 0: tokens 5..7 padded; 5 stays finite
    y = _finite_padding(x, VALID, jnp.float32)
    np.testing.assert_array_equal(y[0, 6:], 0.0)
    np.testing.assert_array_equal(y[0, :6], X[0, :6])
    np.testing.assert_array_equal(y[1], X[1])
    w = _loss_weights(x.shape)
    g = jax.grad(lambda x: jnp.sum(_finite_padding(x, VALID, jnp.float32) * w))(x)
    np.testing.assert_array_equal(g[0, 6:], 0.0)
    np.testing.assert_array_equal(g[0, :6], w[0, :6])
    np.testing.assert_array_equal(g[1], w[1])
