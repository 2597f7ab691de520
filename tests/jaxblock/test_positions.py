"""Positions: the sinusoidal table's layout, RoPE's relative-offset property, and what each choice does
to the Encoder's permutation equivariance."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import Encoder, EncoderConfig, unbox
from jaxblock.positions import apply_rope, sinusoidal_table


def test_sinusoidal_layout_sin_on_even_cos_on_odd_features():
    table = np.asarray(sinusoidal_table(3, 4))
    np.testing.assert_allclose(table[0], [0.0, 1.0, 0.0, 1.0], atol=1e-7)
    # Feature pair i uses angle p / 10000^(2i/D): D=4 gives 1 and 1/100.
    np.testing.assert_allclose(table[2], [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)], atol=1e-6)
    odd = np.asarray(sinusoidal_table(2, 5))  # an odd width ends on a sine feature
    np.testing.assert_allclose(odd[1, 4], math.sin(1 / 10000 ** (4 / 5)), atol=1e-7)


def test_rope_hand_value_and_position_zero_is_identity():
    # K=2: one pair (x1, x2) rotated by angle p * base^0 = p.
    x = jnp.array([[[[1.0, 0.0]], [[1.0, 0.0]]]])  # [N=1, L=2, H=1, K=2]
    out = np.asarray(apply_rope(x, jnp.array([[0, 1]])))
    np.testing.assert_allclose(out[0, 0, 0], [1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(out[0, 1, 0], [math.cos(1.0), math.sin(1.0)], atol=1e-6)


def _scores(q, k, positions) -> np.ndarray:
    """[L, L] scores of a fixed query vector and key vector placed at `positions`, after RoPE."""
    length = len(positions)
    pos = jnp.asarray(positions)[None, :]  # [N=1, L]
    rq = apply_rope(jnp.broadcast_to(q, (1, length, 1, q.shape[-1])), pos)  # [1, L, 1, K]
    rk = apply_rope(jnp.broadcast_to(k, (1, length, 1, k.shape[-1])), pos)
    return np.asarray(jnp.einsum("QK,MK->QM", rq[0, :, 0], rk[0, :, 0]))


def test_rope_scores_depend_only_on_the_relative_offset():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=8), jnp.float32) for _ in range(2))
    s = _scores(q, k, list(range(6)))
    # Same offset j - i, same score: the score matrix is constant along every diagonal ...
    np.testing.assert_allclose(s[1:, 1:], s[:-1, :-1], atol=1e-5)
    # ... and shifting every position by 100 changes nothing.
    np.testing.assert_allclose(_scores(q, k, list(range(100, 106))), s, atol=1e-4)
    # Different offsets do give different scores (the test is not vacuous).
    assert abs(s[0, 1] - s[0, 3]) > 1e-2 and abs(s[0, 1] - s[1, 0]) > 1e-2


def test_rope_is_a_rotation():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 3, 8)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    out = apply_rope(x, pos)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    assert apply_rope(x.astype(jnp.bfloat16), pos).dtype == jnp.bfloat16


N, L, D = 2, 6, 8


def _encoder_params(cfg: EncoderConfig) -> dict:
    t = jax.ShapeDtypeStruct((N, L), jnp.int32)
    v = jax.ShapeDtypeStruct((N, L), jnp.bool_)
    shapes = jax.eval_shape(lambda a, b: unbox(Encoder(cfg).init(jax.random.key(0), a, b)), t, v)["params"]
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes)


@pytest.mark.parametrize(
    "positions,equivariant",
    [("none", True), pytest.param("learned", False, marks=pytest.mark.slow),
     pytest.param("sinusoidal", False, marks=pytest.mark.slow), ("rope", False)]
)
def test_only_positions_none_is_permutation_equivariant(positions, equivariant):
    rope = positions == "rope"
    cfg = EncoderConfig(
        vocab_size=11, max_len=L, num_layers=2, embedding=dict(positions="none" if rope else positions),
        block=dict(model_dim=D, num_heads=2, ffn_dim=16, attention=dict(rope=rope)),
    )
    params = _encoder_params(cfg)
    assert ("pos_embedding" in params) == (positions == "learned")
    tokens = jnp.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]], jnp.int32)
    valid = jnp.ones((N, L), bool)
    perm = np.array([4, 2, 0, 5, 1, 3])
    enc = lambda t: np.asarray(Encoder(cfg).apply({"params": params}, t, valid))
    moved = enc(tokens[:, perm]) - enc(tokens)[:, perm]  # permute-then-encode vs encode-then-permute
    if equivariant:
        np.testing.assert_allclose(moved, 0.0, atol=1e-5)
    else:
        assert np.abs(moved).max() > 1e-2
