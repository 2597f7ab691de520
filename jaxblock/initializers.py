"""Parameter initializers for the two `init` schemes, with logical axis names attached.

'flax': LeCun-normal kernels (fan-in over the contracted axes), zero biases.
'torch': the distributions of torch.nn.TransformerEncoderLayer: the fused q/k/v in_proj is
Xavier-uniform over its [3D, D] matrix with zero bias; every other nn.Linear is
kaiming-uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)) with bias U(+-1/sqrt(fan_in)), except
the attention out_proj bias, which MultiheadAttention zeroes.
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

Init = Any


def logical(init: Init, axes: tuple[str | None, ...]) -> Init:
    """`init` boxed with the logical names of its array's axes (flax.linen.with_logical_partitioning); the
    parameter `Module.param` declares with it reads as a plain array."""
    return nn.with_logical_partitioning(init, axes)


def uniform(bound: float) -> Init:
    def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def kernel_init(
    scheme: str,
    fan_in: int,
    in_axis: int | Sequence[int],
    out_axis: int | Sequence[int],
    axes: tuple[str | None, ...],
    torch_bound: float | None = None,
) -> Init:
    """A kernel initializer for `scheme`, boxed with logical `axes`.

    torch_bound overrides PyTorch's default U(+-1/sqrt(fan_in)) (used for the Xavier in_proj).
    """
    if scheme == "torch":
        init = uniform(torch_bound if torch_bound is not None else 1.0 / math.sqrt(fan_in))
    else:
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis, out_axis)
    return logical(init, axes)


def bias_init(scheme: str, fan_in: int, axes: tuple[str | None, ...], zero: bool = False) -> Init:
    if scheme == "torch" and not zero:
        init = uniform(1.0 / math.sqrt(fan_in))
    else:
        init = nn.initializers.zeros_init()
    return logical(init, axes)


def abstract_params(model: nn.Module, length: int = 1) -> Any:
    """The `params` collection `init_boxed` makes for a [1, length] batch, as
    jax.ShapeDtypeStructs boxed with their logical axis names: `nn.unbox` gives the shapes and dtypes,
    `nn.get_partition_spec` the logical PartitionSpecs. Nothing is computed or compiled.

    Tracing an encoder's init, even abstractly, costs ~0.1 s (every module, every initializer), and a
    conversion, a restore and a run each need these shapes, often for the same model. Flax modules compare
    by their fields, so the trace is kept per (model, length) and equal models share it; each call gets its
    own copy of the tree. A model with an unhashable field is traced on every call."""
    x64 = jax.dtypes.canonicalize_dtype(np.float64) == np.float64
    try:
        hash(model)
    except TypeError:  # an unhashable field: no cache key
        return _abstract_params.__wrapped__(model, length, x64)
    return jax.tree.map(lambda leaf: leaf, _abstract_params(model, length, x64))


def init_boxed(model: nn.Module, seed: int, length: int) -> Any:
    """The `params` collection `model.init` makes from `seed` for a dummy [1, length] batch (all tokens
    real), boxed with its logical axis names; `abstract_params` is its shapes, computed without it."""
    tokens = jnp.zeros((1, length), jnp.int32)
    valid = jnp.ones((1, length), jnp.bool_)
    return model.init(jax.random.key(seed), tokens, valid)["params"]


@functools.lru_cache(maxsize=32)
def _abstract_params(model: nn.Module, length: int, x64: bool) -> Any:
    del x64  # part of the key only: it decides the dtypes the trace gives
    return jax.eval_shape(lambda: init_boxed(model, 0, length))


class Weights(nn.Module):
    """Declares one projection's `kernel` (and `bias`) and returns them; the caller does the einsum.

    Keeping the arithmetic in the caller lets attention concatenate q/k/v kernels at call time
    (one fused matmul) while the parameter tree keeps them separate.
    """

    kernel_shape: tuple[int, ...]
    kernel_init: Init
    bias_shape: tuple[int, ...]
    bias_init: Init
    use_bias: bool
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array | None]:
        kernel = self.param("kernel", self.kernel_init, self.kernel_shape, self.param_dtype)
        bias = self.param("bias", self.bias_init, self.bias_shape, self.param_dtype) if self.use_bias else None
        return kernel, bias
