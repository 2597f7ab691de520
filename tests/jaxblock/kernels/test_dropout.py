"""jaxblock.kernels.dropout: the unrolled-Threefry keep mask is jax.random.bernoulli's, bit for bit, for every
key kind and shape it takes on (others go to jax.random.bernoulli itself), it compiles to one pass with no loop,
and Dropout is flax's nn.Dropout with that mask, on a CPU and when traced for another platform."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock.attention.platform import for_platform
from jaxblock.kernels.dropout import Dropout, bernoulli

# Shapes with odd sizes and axes of 1; each with its own key and p (0 and 1 included).
CASES = [((), 0.9), ((7,), 0.5), ((3, 5), 0.0), ((2, 3, 4, 5), 1e-3), ((2, 1, 3, 1, 4), 1.0), ((4, 33), 0.9)]


@pytest.mark.parametrize("make_key", [lambda s: jax.random.key(s), lambda s: jax.random.PRNGKey(s)],
                         ids=["typed", "raw"])
def test_the_mask_is_jax_random_bernoullis(make_key):
    def both(key):
        return [(bernoulli(jax.random.fold_in(key, i), p, shape),
                 jax.random.bernoulli(jax.random.fold_in(key, i), p, shape)) for i, (shape, p) in enumerate(CASES)]

    for (shape, p), (ours, theirs) in zip(CASES, jax.jit(both)(make_key(3)), strict=True):
        assert ours.shape == theirs.shape == shape and ours.dtype == jnp.bool_
        np.testing.assert_array_equal(ours, theirs, err_msg=f"{shape} p={p}")
    assert 0 < int(bernoulli(make_key(0), 0.5, (64,)).sum()) < 64  # a mid p gives a mix


def test_another_prng_implementation_is_drawn_by_jax_itself():
    key = jax.random.key(0, impl="rbg")
    np.testing.assert_array_equal(bernoulli(key, 0.7, (4, 6)), jax.random.bernoulli(key, 0.7, (4, 6)))


def test_the_mask_is_one_pass_without_the_hash_loop():
    text = jax.jit(lambda k: bernoulli(k, 0.9, (8, 4, 16, 16))).lower(jax.random.key(0)).compile().as_text()
    assert " while(" not in text
    loop = jax.jit(lambda k: jax.random.bernoulli(k, 0.9, (8, 4, 16, 16))).lower(jax.random.key(0))
    if jax.default_backend() == "cpu":  # jax's own CPU lowering loops over the rounds
        assert " while(" in loop.compile().as_text()


@pytest.mark.parametrize("platform", [None, "tpu"])
@pytest.mark.parametrize("broadcast_dims", [(), (1,)])
def test_dropout_is_flaxs_with_the_same_rng(broadcast_dims, platform):
    x = jax.random.normal(jax.random.key(1), (3, 6, 8))
    rngs = {"dropout": jax.random.key(2)}
    with for_platform(platform or jax.default_backend()):
        for rate in (0.1, 0.5, 0.0):
            ours = Dropout(rate, broadcast_dims=broadcast_dims).apply({}, x, deterministic=False, rngs=rngs)
            theirs = nn.Dropout(rate, broadcast_dims=broadcast_dims).apply({}, x, deterministic=False, rngs=rngs)
            np.testing.assert_array_equal(ours, theirs)
        dropped = Dropout(0.5).apply({}, x, deterministic=False, rngs=rngs)
        assert 0 < int(jnp.sum(dropped == 0)) < x.size
        np.testing.assert_array_equal(Dropout(0.5).apply({}, x, deterministic=True), x)
        np.testing.assert_array_equal(Dropout(1.0).apply({}, x, deterministic=False, rngs=rngs), jnp.zeros_like(x))
