"""Dropout's keep mask on a CPU: `jax.random.bernoulli`'s very bits, in one fused pass (a kernel).

    keep = bernoulli(key, 0.9, (N, L, D))   # == jax.random.bernoulli(key, 0.9, (N, L, D)), element for element
    y = Dropout(0.1)(x, deterministic=False) # flax.linen.Dropout: the same rng, mask and result on every platform

Why: on a CPU, JAX lowers its Threefry-2x32 hash as a loop over its rounds, and XLA's CPU backend writes both
32-bit words of every element to memory on each pass of that loop. Written out with its 20 rounds unrolled
(JAX's own lowering on accelerators), the hash, the float conversion and the comparison are one elementwise
fusion that writes only the mask. `python -m bench.e2e --side before=751c425 --side dropout-off=...` measured
what it buys end to end on the main job (bench/records/e2e-main-*.md).

`Dropout` is flax's nn.Dropout; it draws its mask here when the step is traced for a CPU
(jaxblock/attention/platform.py `target_platform`, as the attention dispatch chooses) and with
`jax.random.bernoulli` elsewhere. Same bits: the counter of each element is its row-major index (JAX's
partitionable Threefry, `jax_threefry_partitionable`, the default), the key words are
`jax.random.key_data(key)`, the float and the comparison are `jax.random.uniform`'s and `bernoulli`'s for a
float32 p. Where any of that does not hold (another PRNG implementation, the non-partitionable layout, a
float64 p, 2**32 elements or more) `bernoulli` calls `jax.random.bernoulli` itself.
tests/jaxblock/kernels/test_dropout.py holds the two equal.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxblock.attention.platform import target_platform
from jaxblock.kernels import recompute
from jaxblock.kernels.projection import Gradients

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, d: int) -> jax.Array:
    return lax.shift_left(x, np.uint32(d)) | lax.shift_right_logical(x, np.uint32(32 - d))


def threefry2x32(k1: jax.Array, k2: jax.Array, x0: jax.Array, x1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of the counter words (x0, x1) under the key (k1, k2): jax's hash, unrolled."""
    ks = (k1, k2, k1 ^ k2 ^ _PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotate_left(x1, r)
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _flag(name: str) -> Any:
    """A JAX configuration value (read at trace time, as jax.random reads it)."""
    return getattr(jax.config, name)


def _key_words(key: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """The two uint32 words of a Threefry key (typed, or a raw uint32[2] of the default implementation);
    None for any other key."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != () or "threefry" not in str(jax.random.key_impl(key)):
            return None
        data = jax.random.key_data(key)
    elif key.dtype == jnp.uint32 and key.shape == (2,) and "threefry" in str(_flag("jax_default_prng_impl")):
        data = key
    else:
        return None
    return data[0], data[1]


def bernoulli(key: jax.Array, p: float, shape: Sequence[int]) -> jax.Array:
    """bool[shape], True with probability p: `jax.random.bernoulli(key, p, shape)`, bit for bit."""
    shape = tuple(int(s) for s in shape)
    words = _key_words(key)
    size = math.prod(shape)
    if words is None or not _flag("jax_threefry_partitionable") or size >= 2**32 or lax.dtype(p) != jnp.float32:
        return jax.random.bernoulli(key, p, shape)
    # Counters: the element's row-major index as a 64-bit number, high word 0 (size < 2**32).
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride)
        stride *= shape[dim]
    bits0, bits1 = threefry2x32(words[0], words[1], jnp.zeros(shape, jnp.uint32), index)
    bits = bits0 ^ bits1
    # jax.random.uniform's float in [0, 1) from the top 23 bits; bernoulli compares it with p.
    floats = lax.bitcast_convert_type(lax.shift_right_logical(bits, np.uint32(9)) | np.uint32(0x3F800000),
                                      jnp.float32) - jnp.float32(1.0)
    return floats < jnp.float32(p)


def mask_kernel() -> tuple[str, str]:
    """(kernel, reason) of the dropout masks for the platform being traced for, as run.json records it."""
    if target_platform() == "cpu":
        return "threefry_unrolled", ("CPU: jax.random.bernoulli's bits with the hash's rounds unrolled, one fused "
                                     "pass (JAX's CPU lowering loops over them)")
    return "jax.random.bernoulli", "off the CPU JAX's own lowering is already unrolled"


def keep_mask(key: jax.Array, p: float, shape: Sequence[int]) -> jax.Array:
    """The keep mask for the platform being traced for: `bernoulli` above on a CPU, jax's elsewhere (equal)."""
    if mask_kernel()[0] == "threefry_unrolled":
        return bernoulli(key, p, shape)
    return jax.random.bernoulli(key, p, tuple(shape))


def dropped(x: jax.Array, keep: jax.Array, rate: float) -> jax.Array:
    """x with the keep mask applied: x / (1 - rate) where keep, 0 elsewhere (flax's Dropout, given its mask)."""
    return lax.select(keep, x / (1.0 - rate), jnp.zeros_like(x))


def dropout(x: jax.Array, rng: jax.Array, rate: float, shape: Sequence[int] | None = None) -> jax.Array:
    """flax's Dropout of x with its mask drawn from rng: of `shape` (broadcast to x's; default x's own)."""
    keep = keep_mask(rng, 1.0 - rate, x.shape if shape is None else shape)
    return dropped(x, jnp.broadcast_to(keep, x.shape), rate)


class Dropout(nn.Dropout):
    """flax.linen.Dropout, its keep mask from `keep_mask`: the same rng stream, mask and result. Where
    jaxblock/kernels/recompute.py recomputes (a GPU), the backward redraws the mask from the rng instead of
    keeping a bool per element; `gradients="plain"` keeps it there too."""

    gradients: Gradients = "auto"

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool | None = None,
                 rng: jax.Array | None = None) -> Any:
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:  # as flax: no NaN gradients at 1.0
            return jnp.zeros_like(inputs)
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        shape = list(inputs.shape)
        for dim in self.broadcast_dims:
            shape[dim] = 1
        drop = functools.partial(dropout, rate=self.rate, shape=shape)
        return recompute.recomputed(drop, self.gradients)(inputs, rng)

    def rng(self) -> jax.Array:
        """The key this module's call would draw its mask from (for a kernel that draws the mask itself)."""
        return self.make_rng(self.rng_collection)

    def keep(self, shape: Sequence[int]) -> jax.Array:
        """The keep mask of the given shape from this module's rng stream: for kernels that apply dropout
        inside themselves (the draw calling the module on an array of that shape would make)."""
        return keep_mask(self.make_rng(self.rng_collection), 1.0 - self.rate, shape)
