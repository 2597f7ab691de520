"""MaskedLM: tied/untied output parameters, shapes, padding independence, loss over chosen tokens only."""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxblock import EncoderConfig
from jaxblock.mlm import MaskedLM, chunked_cross_entropy, cross_entropy, mlm_loss, select_positions

V, D, N, L = 50, 16, 3, 8


def config(**kw: object) -> EncoderConfig:
    return EncoderConfig(num_layers=1, vocab_size=V, max_len=L,
                         block={"model_dim": D, "num_heads": 2, "ffn_dim": 32}, **kw)  # type: ignore[arg-type]


def batch(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    lengths = np.array([L, 5, 2])
    valid = np.arange(L)[None, :] < lengths[:, None]
    tokens = np.where(valid, rng.integers(2, V, (N, L)), 0)
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(valid)


def init(model: MaskedLM, **kw: object) -> dict:
    tokens, valid = batch()
    return nn.unbox(jax.jit(functools.partial(model.init, **kw))(jax.random.key(0), tokens, valid)["params"])


def test_tied_output_shares_the_embedding_and_gets_its_gradient() -> None:
    model = MaskedLM(config(), tie_embeddings=True)
    params = init(model)
    assert "output_kernel" not in params and params["output_bias"].shape == (V,)
    tokens, valid = batch()
    # A token that never appears in the input gets an embedding gradient only through the output side.
    absent = next(t for t in range(2, V) if t not in np.asarray(tokens))
    targets = np.full((N, L), absent, np.int32)

    def loss(p: dict) -> jax.Array:
        return mlm_loss(model.apply({"params": p}, tokens, valid), targets, valid)[0]

    grads = jax.jit(jax.grad(loss))(params)
    assert float(np.abs(np.asarray(grads["encoder"]["embedding"])[absent]).sum()) > 0

    # Changing the embedding row of a word changes its output logit: the two are one parameter. (A random
    # change: a constant one is orthogonal to the zero-mean output of the transform's LayerNorm.)
    bumped = jax.tree.map(lambda x: x, params)
    bump = np.random.default_rng(1).normal(size=D).astype(np.float32)  # host arrays: no eager compiles
    embedding = np.array(params["encoder"]["embedding"])
    embedding[absent] += bump
    bumped["encoder"]["embedding"] = embedding
    apply = jax.jit(model.apply)
    before = apply({"params": params}, tokens, valid)
    after = apply({"params": bumped}, tokens, valid)
    assert not np.allclose(before[..., absent], after[..., absent])
    np.testing.assert_allclose(before[..., absent + 1], after[..., absent + 1], rtol=1e-6, atol=1e-6)


def test_untied_output_has_its_own_kernel() -> None:
    model = MaskedLM(config(), tie_embeddings=False)
    params = init(model)
    assert params["output_kernel"].shape == (D, V)
    tokens, valid = batch()
    absent = next(t for t in range(2, V) if t not in np.asarray(tokens))
    grads = jax.device_get(jax.jit(jax.grad(lambda p: mlm_loss(model.apply({"params": p}, tokens, valid),
                                                               np.full((N, L), absent), valid)[0]))(params))
    assert float(np.abs(grads["encoder"]["embedding"][absent]).sum()) == 0
    assert float(np.abs(grads["output_kernel"][:, absent]).sum()) > 0


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("transform", [True, False])
def test_shapes_and_start_at_unit_logit_scale(tied: bool, transform: bool) -> None:
    model = MaskedLM(config(), tie_embeddings=tied, transform=transform)
    params = init(model)
    tokens, valid = batch()
    apply = jax.jit(model.apply)
    logits = apply({"params": params}, tokens, valid)
    assert logits.shape == (N, L, V) and logits.dtype == jnp.float32
    logits = np.asarray(logits)  # host arithmetic below: no eager compiles
    # The untrained loss sits near ln V, not sqrt(D) nats above it (the tied scale in the docstring).
    std = float(np.std(logits))
    assert 0.3 < std < 3.0, std
    positions, _ = jax.jit(select_positions, static_argnums=1)(valid & (np.arange(L) % 2 == 0)[None, :], 4)
    picked = apply({"params": params}, tokens, valid, positions=positions)
    assert picked.shape == (N, 4, V)
    np.testing.assert_allclose(picked, np.take_along_axis(logits, np.asarray(positions)[..., None], axis=1),
                               atol=1e-5)


def test_padding_content_does_not_change_real_positions() -> None:
    model = MaskedLM(config())
    params = init(model)
    tokens, valid = batch()
    other = np.where(valid, tokens, 7)  # different ids in the padded slots
    apply = jax.jit(model.apply)
    a = apply({"params": params}, tokens, valid)
    b = apply({"params": params}, other, valid)
    np.testing.assert_allclose(np.asarray(a)[np.asarray(valid)], np.asarray(b)[np.asarray(valid)], atol=1e-5)


def test_loss_counts_only_chosen_positions() -> None:
    rng = np.random.default_rng(0)  # host arrays and a host reference; the loss compiled once
    logits = rng.normal(size=(N, L, V)).astype(np.float32)
    targets = rng.integers(0, V, (N, L)).astype(np.int32)
    chosen = rng.random((N, L)) < 0.4
    chosen[0, 0] = True
    loss_fn = jax.jit(mlm_loss)
    loss, m = loss_fn(logits, targets, chosen)
    # Reference: the mean over chosen tokens of -log softmax at the target.
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ref = -np.mean(np.take_along_axis(logp, targets[..., None], -1)[..., 0][chosen])
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    assert int(m["count"]) == int(chosen.sum())
    # Unchosen positions may hold anything, even NaN, without reaching the loss or its gradient.
    poisoned = np.where(chosen[..., None], logits, np.nan).astype(np.float32)
    assert math.isclose(float(loss_fn(poisoned, targets, chosen)[0]), float(loss), rel_tol=1e-6)
    g = np.asarray(jax.jit(jax.grad(lambda x: mlm_loss(x, targets, chosen)[0]))(logits))
    assert float(np.abs(g[~chosen]).sum()) == 0
    hits = (np.argmax(logits, -1) == targets)[chosen]
    np.testing.assert_allclose(float(m["accuracy"]), hits.mean(), rtol=1e-6)
    assert float(loss_fn(logits, targets, np.zeros_like(chosen))[0]) == 0.0


def test_select_positions_keeps_order_and_marks_fillers() -> None:
    chosen = jnp.asarray([[False, True, False, True], [False, False, False, False], [True, True, True, True]])
    pos, w = select_positions(chosen, 3)
    np.testing.assert_array_equal(pos, [[1, 3, 0], [0, 0, 0], [0, 1, 2]])
    np.testing.assert_array_equal(w, [[True, True, False], [False, False, False], [True, True, True]])
    with pytest.raises(ValueError, match="max_predictions"):
        select_positions(chosen, 5)


def test_learns_to_copy_on_a_tiny_corpus() -> None:
    """The unmasked input token is the target: a few Adam steps beat the unigram guess by far."""
    import optax

    model = MaskedLM(config())
    params = init(model)
    tokens, valid = batch(1)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(p: dict, o: optax.OptState) -> tuple[dict, optax.OptState, jax.Array]:
        (_, m), g = jax.value_and_grad(
            lambda q: mlm_loss(model.apply({"params": q}, tokens, valid), tokens, valid), has_aux=True)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, m["accuracy"]

    for _ in range(60):
        params, opt, acc = step(params, opt)
    assert float(acc) > 0.9


def test_cross_entropy_is_optaxs_and_its_gradient_writes_no_scatter() -> None:
    """optax's value and gradient; the gradient is elementwise (softmax - onehot), with no scatter of a gather's
    transpose, which XLA's GPU compiler keeps as a second [N, P, V] float32 buffer."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 30, (3, 5, V)), jnp.float32)  # large logits: a saturated softmax
    targets = jnp.asarray(rng.integers(0, V, (3, 5)), jnp.int32)
    ours, theirs = cross_entropy(logits, targets), optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-5)

    def grad(f):
        return jax.grad(lambda x: jnp.sum(f(x, targets) * jnp.arange(5.0)[None, :]))

    np.testing.assert_allclose(grad(cross_entropy)(logits),
                               grad(optax.softmax_cross_entropy_with_integer_labels)(logits), atol=1e-6)
    assert "scatter" in str(jax.make_jaxpr(grad(optax.softmax_cross_entropy_with_integer_labels))(logits))
    assert "scatter" not in str(jax.make_jaxpr(grad(cross_entropy))(logits))


@pytest.mark.parametrize(("tied", "chunks"), [(True, 1), (True, 2), (False, 5)])  # P = 5 slots
def test_the_chunked_loss_is_the_logits_loss_and_keeps_no_logits_for_the_backward(tied: bool, chunks: int) -> None:
    """With targets the head returns cross_entropy(logits) and argmax(logits), and their gradients, without
    keeping the [N, P, V] logits for the backward pass (the vjp's residuals hold none; the logits path's do).
    (Groups: one; a padded last one; one slot each.)"""
    model = MaskedLM(config(), tie_embeddings=tied)
    params = init(model)
    tokens, valid = batch()
    positions, weights = select_positions(valid, 5)
    targets = jnp.asarray(np.random.default_rng(2).integers(0, V, (N, 5)), jnp.int32)
    slot_weights = weights.astype(jnp.float32) * jnp.arange(1.0, 6.0)[None, :]  # a different cotangent a slot

    def through_logits(p: dict) -> tuple[jax.Array, jax.Array]:
        logits = model.apply({"params": p}, tokens, valid, positions=positions)
        return cross_entropy(logits, targets), jnp.argmax(logits, -1).astype(jnp.int32)

    def chunked(p: dict) -> tuple[jax.Array, jax.Array]:
        return model.apply({"params": p}, tokens, valid, positions=positions, targets=targets, chunks=chunks)

    @jax.jit
    def values_and_grads(p: dict) -> tuple[Any, ...]:
        def grad(f):
            return jax.grad(lambda q: jnp.sum(f(q)[0] * slot_weights))(p)
        return through_logits(p), chunked(p), grad(through_logits), grad(chunked)

    (ref_losses, ref_ids), (losses, ids), ref_grads, grads = values_and_grads(params)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ids, ref_ids)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, ref_grads)

    def kept(f) -> list[tuple[int, ...]]:  # the shapes a vjp keeps from the forward to the backward pass
        shapes = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(lambda q: f(q)[0], p)[1]), params)
        return [tuple(leaf.shape) for leaf in shapes]

    assert (N, 5, V) in kept(through_logits)
    assert not any(shape[-1:] == (V,) and len(shape) >= 3 for shape in kept(chunked))


def test_chunked_cross_entropy_refuses_more_groups_than_slots() -> None:
    h = jnp.zeros((2, 3, D))
    with pytest.raises(ValueError, match=r"^chunks=4 must be in 1\.\.P=3$"):
        chunked_cross_entropy(lambda x: x, h, jnp.zeros((2, 3), jnp.int32), 4)
