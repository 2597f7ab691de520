"""jaxblock/kernels/layer_norm.py against the formula: values and gradients, and the choice by platform and config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock.attention.platform import for_platform
from jaxblock.kernels import layer_norm


@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_the_written_backward_equals_the_formulas_autodiff(scale: float) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 7, 16)) * scale + 2.0, jnp.float32)
    cot = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def loss(f):
        return lambda x: jnp.sum(f(x, 1e-5) * cot)

    with for_platform("cpu"):
        assert "custom_vjp" in str(jax.make_jaxpr(lambda x: layer_norm.standardize(x, 1e-5))(x))
        got = jax.jit(jax.value_and_grad(loss(layer_norm.standardize)))(x)
    want = jax.jit(jax.value_and_grad(loss(layer_norm.formula)))(x)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-5 / scale)


def test_off_the_cpu_and_when_plain_it_is_the_formula() -> None:
    x = jnp.ones((2, 3, 4)).at[:, :, 0].set(3.0)

    def grad_jaxpr(**kw: str) -> str:  # the forward's jaxpr: a custom VJP shows there as custom_vjp_call
        return str(jax.make_jaxpr(lambda x: layer_norm.standardize(x, 1e-5, **kw))(x))

    for platform in ("gpu", "tpu"):
        with for_platform(platform):
            assert "custom_vjp" not in grad_jaxpr() and layer_norm.kernel()[0] == "autodiff"
    with for_platform("cpu"):
        assert "custom_vjp" not in grad_jaxpr(gradients="plain")
        assert layer_norm.kernel()[0] == "written_backward" and "CPU" in layer_norm.kernel()[1]
