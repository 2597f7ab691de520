"""FeedForward: D -> F -> D with the same weights at every position; GLU variants; dropout; init."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import BlockConfig, FeedForward, LayerNorm, unbox

# The hand example, written PyTorch-style [out, in]; Flax kernels are [in, out], i.e. the transposes.
W1 = np.array([[1.0, -1.0], [0.5, 0.5]])
W2 = np.array([[2.0, 0.0], [0.0, -1.0]])


def _hand_cfg(**kw) -> BlockConfig:
    return BlockConfig(model_dim=2, num_heads=1, ffn_dim=2, activation="relu", **kw)


def _hand_params() -> dict:
    zeros = jnp.zeros(2)
    return {
        "linear1": {"kernel": jnp.asarray(W1.T), "bias": zeros},  # b1 = 0
        "linear2": {"kernel": jnp.asarray(W2.T), "bias": zeros},  # b2 = 0
    }


def _count(tree) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def _shapes(cfg: BlockConfig) -> dict:
    """Parameter shapes without running the initializers (no compilation)."""
    x = jax.ShapeDtypeStruct((1, 1, cfg.model_dim), jnp.float32)
    return jax.eval_shape(lambda v: unbox(FeedForward(cfg).init(jax.random.key(0), v)), x)["params"]


def _init(cfg: BlockConfig, seed: int = 0) -> dict:
    """Random parameters drawn host-side: cheap, and biases are non-zero so they are exercised."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), _shapes(cfg))


def _real_init(cfg: BlockConfig, seed: int) -> dict:
    x = jnp.ones((1, 1, cfg.model_dim))
    return unbox(jax.jit(FeedForward(cfg).init)(jax.random.key(seed), x))["params"]


def test_hand_example_ffn_residual_and_layernorm():
    cfg = _hand_cfg()
    ffn = FeedForward(cfg)
    x = jnp.array([[[1.0, 2.0]]])  # [N=1, L=1, D=2]
    f = ffn.apply({"params": _hand_params()}, x)
    # h = relu(W1 x) = relu([1 - 2, 0.5 + 1]) = [0, 1.5];  W2 h = [0, -1.5]
    np.testing.assert_allclose(np.asarray(f), [[[0.0, -1.5]]], atol=1e-6)
    residual = x + f
    np.testing.assert_allclose(np.asarray(residual), [[[1.0, 0.5]]], atol=1e-6)
    ln_cfg = BlockConfig(model_dim=2, num_heads=1, ffn_dim=2, use_bias=False, norm_eps=1e-12)
    y = LayerNorm(ln_cfg).apply({"params": {"scale": jnp.ones(2)}}, residual)  # no affine: scale 1, no bias
    np.testing.assert_allclose(np.asarray(y), [[[1.0, -1.0]]], atol=1e-5)


def test_second_token_gets_its_own_result_and_leaves_the_first_unchanged():
    ffn = FeedForward(_hand_cfg())
    params = {"params": _hand_params()}
    one = ffn.apply(params, jnp.array([[[1.0, 2.0]]]))
    two = ffn.apply(params, jnp.array([[[1.0, 2.0], [-1.0, 1.0]]]))  # [N=1, L=2, D=2]
    # Second token: h = relu([-1 - 1, -0.5 + 0.5]) = [0, 0] -> output [0, 0].
    np.testing.assert_allclose(np.asarray(two), [[[0.0, -1.5], [0.0, 0.0]]], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(two[:, :1]), np.asarray(one))


def test_positions_never_mix():
    # Changing one position's input moves that position's output and no other.
    cfg = BlockConfig(model_dim=4, num_heads=1, ffn_dim=8, activation="swiglu")
    params = {"params": _init(cfg)}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 4)), jnp.float32)
    y = np.asarray(FeedForward(cfg).apply(params, x))
    y2 = np.asarray(FeedForward(cfg).apply(params, x.at[:, 1].add(1.0)))
    np.testing.assert_array_equal(y2[:, [0, 2]], y[:, [0, 2]])
    assert np.abs(y2[:, 1] - y[:, 1]).min() > 0.0


def test_shapes_hidden_is_f_output_is_d():
    cfg = BlockConfig(model_dim=4, num_heads=1, ffn_dim=12)
    params = _init(cfg)
    assert params["linear1"]["kernel"].shape == (4, 12) and params["linear2"]["kernel"].shape == (12, 4)
    assert params["linear1"]["bias"].shape == (12,) and params["linear2"]["bias"].shape == (4,)
    y = FeedForward(cfg).apply({"params": params}, jnp.ones((2, 3, 4)))
    assert y.shape == (2, 3, 4)


@pytest.mark.parametrize(
    "activation,fn",
    [
        ("relu", lambda a: np.maximum(a, 0.0)),
        ("gelu", lambda a: 0.5 * a * (1.0 + np.vectorize(math.erf)(a / math.sqrt(2.0)))),
        ("gelu_tanh", lambda a: 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))),
    ],
)
def test_plain_activations_match_their_formulas(activation, fn):
    cfg = BlockConfig(model_dim=4, num_heads=1, ffn_dim=6, activation=activation)
    params = _init(cfg, seed=3)
    x = np.random.default_rng(2).normal(size=(1, 3, 4))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    ref = fn(x @ p["linear1"]["kernel"] + p["linear1"]["bias"]) @ p["linear2"]["kernel"] + p["linear2"]["bias"]
    y = FeedForward(cfg).apply({"params": params}, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)


@pytest.mark.parametrize(
    "activation,gate_fn",
    [
        ("swiglu", lambda a: a / (1.0 + np.exp(-a))),
        ("geglu", lambda a: 0.5 * a * (1.0 + np.vectorize(math.erf)(a / math.sqrt(2.0)))),
    ],
)
def test_glu_is_act_of_gate_times_up_projection(activation, gate_fn):
    cfg = BlockConfig(model_dim=4, num_heads=1, ffn_dim=6, activation=activation)
    params = _init(cfg, seed=4)
    assert set(params) == {"linear1", "gate", "linear2"}
    x = np.random.default_rng(5).normal(size=(2, 3, 4))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    gate = gate_fn(x @ p["gate"]["kernel"] + p["gate"]["bias"])
    up = x @ p["linear1"]["kernel"] + p["linear1"]["bias"]
    ref = (gate * up) @ p["linear2"]["kernel"] + p["linear2"]["bias"]
    y = FeedForward(cfg).apply({"params": params}, jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)


@pytest.mark.parametrize("d", [8, 16])
def test_parameter_counts(d):
    plain = BlockConfig(model_dim=d, num_heads=2, ffn_dim=4 * d, use_bias=False)
    assert _count(_shapes(plain)) == 8 * d * d  # two [D, 4D] matrices
    glu = plain.model_copy(update={"activation": "swiglu"})
    assert _count(_shapes(glu)) == 12 * d * d  # three matrices: gate, up, down
    biased = plain.model_copy(update={"use_bias": True})
    assert _count(_shapes(biased)) == 8 * d * d + 4 * d + d


def test_hidden_dropout_scales_kept_units_and_is_off_in_eval():
    # linear2 = identity and positive hidden units make the output the dropped hidden layer itself.
    p = 0.5
    cfg = BlockConfig(model_dim=8, num_heads=1, ffn_dim=8, activation="relu", ffn_dropout=p)
    params = {
        "linear1": {"kernel": jnp.eye(8), "bias": jnp.zeros(8)},
        "linear2": {"kernel": jnp.eye(8), "bias": jnp.zeros(8)},
    }
    x = jnp.arange(1.0, 1.0 + 4 * 8 * 8).reshape(4, 8, 8)
    ffn = FeedForward(cfg)
    np.testing.assert_array_equal(np.asarray(ffn.apply({"params": params}, x)), np.asarray(x))
    y = np.asarray(ffn.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.key(0)}))
    kept = y != 0.0
    np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / (1 - p), rtol=1e-6)
    assert 0.35 < kept.mean() < 0.65  # 256 Bernoulli(0.5) draws


def test_torch_init_distributions():
    d, f = 64, 256
    cfg = BlockConfig(model_dim=d, num_heads=4, ffn_dim=f, init="torch")
    params = _real_init(cfg, seed=7)
    for name, fan_in in (("linear1", d), ("linear2", f)):
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)), bias the same
        for leaf in ("kernel", "bias"):
            a = np.asarray(params[name][leaf])
            assert np.abs(a).max() <= bound
            assert np.abs(a).max() > 0.9 * bound
        k = np.asarray(params[name]["kernel"])
        np.testing.assert_allclose(k.std(), bound / math.sqrt(3.0), rtol=0.05)  # uniform std = b / sqrt(3)


def test_flax_init_is_lecun_normal_with_zero_bias():
    d, f = 64, 256
    params = _real_init(BlockConfig(model_dim=d, num_heads=4, ffn_dim=f), seed=8)
    np.testing.assert_allclose(np.asarray(params["linear1"]["kernel"]).std(), 1 / math.sqrt(d), rtol=0.05)
    np.testing.assert_allclose(np.asarray(params["linear2"]["kernel"]).std(), 1 / math.sqrt(f), rtol=0.05)
    assert not np.any(np.asarray(params["linear1"]["bias"]))


def test_wrong_rank_or_width_is_rejected():
    cfg = BlockConfig(model_dim=4, num_heads=1, ffn_dim=8)
    params = {"params": _init(cfg)}
    with pytest.raises(AssertionError):
        FeedForward(cfg).apply(params, jnp.ones((3, 4)))
    with pytest.raises(AssertionError):
        FeedForward(cfg).apply(params, jnp.ones((1, 3, 5)))
