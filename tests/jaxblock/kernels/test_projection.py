"""jaxblock/kernels/projection.py against the plain einsum: values, both gradients, every projection spec the model
uses, both branches of the backward (x or dy the smaller), and the choice by platform and config."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock.attention.platform import for_platform
from jaxblock.kernels import projection

SPECS = {  # spec -> (x shape, w shape): the model's projections, with x the smaller and dy the smaller
    "NLD,DF->NLF": ((2, 5, 8), (8, 24)),   # FFN up: x [T, 8] smaller than dy [T, 24]
    "NLF,FD->NLD": ((2, 5, 24), (24, 8)),  # FFN down: dy [T, 8] smaller
    "NLD,DGK->NLGK": ((2, 5, 8), (8, 2, 4)),
    "NLD,DTHK->NLTHK": ((2, 5, 8), (8, 3, 2, 4)),
    "NLHK,HKD->NLD": ((2, 5, 2, 4), (2, 4, 6)),
}


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("spec", SPECS)
def test_values_and_gradients_equal_the_einsums(spec: str, platform: str) -> None:
    xs, ws = SPECS[spec]
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in (xs, ws))
    cot = jnp.asarray(rng.normal(size=jnp.einsum(spec, x, w).shape), jnp.float32)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w) * cot)

    def ours(x, w):
        return projection.einsum(spec, x, w)

    with for_platform(platform):
        assert "custom_vjp" in str(jax.make_jaxpr(ours)(x, w))
        got = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.value_and_grad(loss(lambda x, w: jnp.einsum(spec, x, w)), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for a, b in zip(got[1], want[1], strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_on_a_tpu_and_when_plain_it_is_jnp_einsum() -> None:
    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))

    def grad_jaxpr(**kw: str) -> str:  # the forward's jaxpr: a custom VJP shows there as custom_vjp_call
        return str(jax.make_jaxpr(lambda w: projection.einsum("NLD,DF->NLF", x, w, **kw))(w))

    with for_platform("tpu"):
        assert "custom_vjp" not in grad_jaxpr() and projection.kernel()[0] == "einsum"
    for platform in ("cpu", "gpu"):
        with for_platform(platform):
            assert "custom_vjp" not in grad_jaxpr(gradients="plain")
            assert projection.kernel("plain")[0] == "einsum"
    with for_platform("cpu"):
        assert projection.kernel()[0] == "smaller_operand_transposed" and "CPU" in projection.kernel()[1]
    with for_platform("gpu"):
        assert projection.kernel()[0] == "weight_gradient_in_layer" and "GPU" in projection.kernel()[1]


def test_on_a_gpu_the_weight_gradient_and_dx_leave_the_backward_together() -> None:
    """One optimization barrier whose operands are dx [N, L, I] and dW [I, O]: the layer below, which needs dx,
    cannot be scheduled before this layer's weight gradient (the plain backward has no barrier)."""
    x, w = jnp.ones((2, 3, 4), jnp.bfloat16), jnp.ones((4, 5), jnp.bfloat16)

    def barriers(**kw: str) -> list:
        grad = jax.grad(lambda x, w: jnp.sum(projection.einsum("NLD,DF->NLF", x, w, **kw)), argnums=(0, 1))
        jaxpr = jax.make_jaxpr(grad)(x, w).jaxpr
        found = []

        def walk(jx) -> None:
            for eqn in jx.eqns:
                if eqn.primitive.name == "optimization_barrier":
                    found.append(sorted(tuple(v.aval.shape) for v in eqn.invars))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr)
        return found

    with for_platform("gpu"):
        assert barriers() == [[(2, 3, 4), (4, 5)]]
        assert barriers(gradients="plain") == []


def test_a_spec_of_another_form_is_jnp_einsum_and_mismatched_shapes_are_one_line() -> None:
    x = jnp.ones((2, 3, 4))
    with for_platform("cpu"):
        np.testing.assert_array_equal(projection.einsum("NLD,MLD->NM", x, x), jnp.einsum("NLD,MLD->NM", x, x))
        with pytest.raises(ValueError, match="do not match"):
            projection.einsum("NLD,DF->NLF", x, jnp.ones((5, 6)))
