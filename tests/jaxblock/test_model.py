"""EncoderStack, Encoder, pooling and Classifier: final norm by placement, scan and remat equivalence,
padding invariance of the pooled logits (and its failure without either mask), packed rows, bf16.

Shapes: N=2, L=6, D=8, H=2, F=16, B=2 blocks, V=11, C=3; row 0 has 4 real tokens, row 1 has 6.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxblock import (
    Classifier,
    Encoder,
    EncoderBlock,
    EncoderConfig,
    EncoderStack,
    LayerNorm,
    StackConfig,
    masked_mean,
    segment_mean,
    stack_layer_params,
    unbox,
    unstack_layer_params,
)

N, L, D, V = 2, 6, 8, 11
VALID = jnp.array([[True] * 4 + [False] * 2, [True] * L])
TOKENS = jnp.array([[3, 1, 4, 1, 0, 0], [5, 9, 2, 6, 5, 3]], jnp.int32)
BLOCK = dict(model_dim=D, num_heads=2, ffn_dim=16)


def _ecfg(block=None, **kw) -> EncoderConfig:
    base = dict(vocab_size=V, max_len=8, num_layers=2, num_classes=3, block={**BLOCK, **(block or {})})
    return EncoderConfig(**{**base, **kw})


def _random(tree_of_shapes, seed: int):
    """Host-drawn random values for a tree of shapes: norm scales near 1, all else non-zero."""
    rng = np.random.default_rng(seed)

    def draw(path, s):
        centre = 1.0 if path[-1].key == "scale" else 0.0
        return jnp.asarray(centre + rng.normal(0.0, 0.4, s.shape), s.dtype)

    return jax.tree_util.tree_map_with_path(draw, tree_of_shapes)


def _stack_params(cfg: StackConfig, seed: int = 0, boxed: bool = False):
    x = jax.ShapeDtypeStruct((N, L, D), jnp.float32)
    v = jax.ShapeDtypeStruct((N, L), jnp.bool_)
    shapes = jax.eval_shape(lambda a, b: EncoderStack(cfg).init(jax.random.key(0), a, b), x, v)["params"]
    return shapes if boxed else _random(unbox(shapes), seed)


def _classifier_params(cfg: EncoderConfig, seed: int = 0) -> dict:
    t = jax.ShapeDtypeStruct((N, L), jnp.int32)
    v = jax.ShapeDtypeStruct((N, L), jnp.bool_)
    shapes = jax.eval_shape(lambda a, b: unbox(Classifier(cfg).init(jax.random.key(0), a, b)), t, v)
    return _random(shapes["params"], seed)


def _x(seed: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(N, L, D)), jnp.float32)


def _stack(cfg, params, x, valid=VALID, **kw):
    return EncoderStack(cfg).apply({"params": params}, x, valid, **kw)


def _logits(cfg, params, tokens=TOKENS, valid=VALID, **kw) -> np.ndarray:
    return np.asarray(Classifier(cfg).apply({"params": params}, tokens, valid, **kw))


# --- the stack: B blocks and the final norm by placement -----------------------------------------


def test_stack_is_its_blocks_in_order_then_the_final_norm():
    cfg = StackConfig(num_layers=2, block=BLOCK)
    params, x = _stack_params(cfg), _x()
    h = x
    for i in range(2):
        h = EncoderBlock(cfg.block).apply({"params": params[f"layers_{i}"]}, h, VALID)
    expected = LayerNorm(cfg.block).apply({"params": params["final_norm"]}, h)
    np.testing.assert_allclose(np.asarray(_stack(cfg, params, x)), np.asarray(expected), atol=1e-6)


def test_pre_ln_stack_output_is_normalized_per_token():
    cfg = StackConfig(num_layers=2, block=BLOCK)
    params = _stack_params(cfg)
    assert "final_norm" in params
    params["final_norm"] = {"scale": jnp.ones(D), "bias": jnp.zeros(D)}  # the default affine
    y = np.asarray(_stack(cfg, params, 3.0 * _x()))
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-3)


def test_post_ln_stack_has_no_final_norm_unless_asked():
    post = StackConfig(num_layers=2, block={**BLOCK, "norm": "post"})
    assert set(_stack_params(post)) == {"layers_0", "layers_1"}
    with_norm = post.model_copy(update={"final_norm": True})
    params = _stack_params(with_norm)
    assert "final_norm" in params
    without = {k: v for k, v in params.items() if k != "final_norm"}
    h = np.asarray(_stack(post, without, _x()))
    expected = LayerNorm(post.block).apply({"params": params["final_norm"]}, jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(_stack(with_norm, params, _x())), np.asarray(expected), atol=1e-6)


# --- scan over layers and remat ---------------------------------------------------------------


def test_scan_matches_the_unrolled_stack_and_the_converters_round_trip():
    cfg = StackConfig(num_layers=3, block=BLOCK)
    scan_cfg = cfg.model_copy(update={"scan_layers": True})
    params = _stack_params(cfg)
    stacked = stack_layer_params(params)
    assert set(stacked) == {"layers", "final_norm"}
    assert stacked["layers"]["self_attn"]["query"]["kernel"].shape == (3, D, 2, 4)  # [B, D, H, K]
    # The scanned module's own tree has the same structure, and its leading axis is named 'layers'.
    boxed = _stack_params(scan_cfg, boxed=True)
    assert jax.tree.structure(unbox(boxed)) == jax.tree.structure(stacked)
    assert boxed["layers"]["ffn"]["linear1"]["kernel"].names == ("layers", "embed", "mlp")
    x = _x()
    np.testing.assert_allclose(
        np.asarray(_stack(scan_cfg, stacked, x)), np.asarray(_stack(cfg, params, x)), atol=1e-5
    )
    back = unstack_layer_params(stacked)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # exact: only stacking and slicing


def test_converters_work_on_a_whole_variables_dict():
    cfg = _ecfg()
    variables = {"params": _classifier_params(cfg)}
    stacked = stack_layer_params(variables)
    assert set(stacked["params"]["encoder"]["stack"]) == {"layers", "final_norm"}
    assert stacked["params"]["encoder"]["embedding"].shape == (V, D)  # other subtrees untouched
    scan_cfg = cfg.model_copy(update={"scan_layers": True})
    np.testing.assert_allclose(
        _logits(scan_cfg, stacked["params"]), _logits(cfg, variables["params"]), atol=1e-5
    )


def test_scanned_layers_draw_their_own_dropout_masks():
    cfg = StackConfig(num_layers=3, scan_layers=True, block={**BLOCK, "residual_dropout": 0.5})
    params = stack_layer_params(_stack_params(cfg.model_copy(update={"scan_layers": False})))
    _, state = EncoderStack(cfg).apply(
        {"params": params}, _x(), VALID, train=True, rngs={"dropout": jax.random.key(0)}, mutable=["intermediates"]
    )
    dropped = np.asarray(state["intermediates"]["layers"]["attn_branch"][0]) == 0.0  # [B, N, L, D]
    assert 0.3 < dropped.mean() < 0.7
    assert np.any(dropped[0] != dropped[1]) and np.any(dropped[1] != dropped[2])  # not one mask reused


def _value_and_grads(cfg, params, x):
    loss = lambda p, a: jnp.sum(_stack(cfg, p, a) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


def _assert_same_value_and_grads(got, want, scanned: bool) -> None:
    (v1, (gp1, gx1)), (v0, (gp0, gx0)) = got, want
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx1), np.asarray(gx0), atol=1e-5)
    gp1 = unstack_layer_params(gp1) if scanned else gp1
    for a, b in zip(jax.tree.leaves(gp1), jax.tree.leaves(gp0), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_remat_gives_the_same_outputs_and_gradients():
    cfg = StackConfig(num_layers=1, block=BLOCK)  # remat wraps each block alike: one shows it
    params, x = _stack_params(cfg), _x()
    want = _value_and_grads(cfg, params, x)
    for remat in ("full", "dots"):
        got = _value_and_grads(cfg.model_copy(update={"remat": remat}), params, x)
        _assert_same_value_and_grads(got, want, scanned=False)


@pytest.mark.slow
def test_remat_inside_scan_gives_the_same_outputs_and_gradients():
    cfg = StackConfig(num_layers=2, block=BLOCK)
    params, x = _stack_params(cfg), _x()
    scanned = cfg.model_copy(update={"remat": "dots", "scan_layers": True})
    got = _value_and_grads(scanned, stack_layer_params(params), x)
    _assert_same_value_and_grads(got, _value_and_grads(cfg, params, x), scanned=True)


# --- pooling ------------------------------------------------------------------------------------------


def test_masked_mean_averages_real_tokens_only():
    x = jnp.array([[[1.0, 10.0], [3.0, 20.0], [100.0, 100.0]], [[5.0, 6.0], [7.0, 8.0], [9.0, 1.0]]])
    valid = jnp.array([[True, True, False], [False, False, False]])
    np.testing.assert_allclose(np.asarray(masked_mean(x, valid)), [[2.0, 15.0], [0.0, 0.0]])  # no token: 0
    with pytest.raises(TypeError, match="valid_tokens must be bool"):
        masked_mean(x, valid.astype(jnp.int32))


def test_segment_mean_averages_each_segment():
    x = jnp.array([[[1.0], [3.0], [10.0], [20.0], [99.0]]])  # [N=1, L=5, D=1]
    seg = jnp.array([[0, 0, 1, 1, 1]], jnp.int32)
    valid = jnp.array([[True, True, True, True, False]])
    np.testing.assert_allclose(np.asarray(segment_mean(x, valid, seg, 3)), [[[2.0], [15.0], [0.0]]])


# --- padding invariance of the pooled logits -----------------------------------------------------


# Each placement, norm type and activation, and each placement with each norm type, in the default suite (five
# models); the rest of the grid under -m slow.
_POOLED_DEFAULT = {("pre", "layernorm", "relu"), ("post", "rmsnorm", "gelu"), ("pre", "rmsnorm", "gelu_tanh"),
                   ("post", "layernorm", "swiglu"), ("pre", "layernorm", "geglu")}


@pytest.mark.parametrize(("norm", "norm_type", "activation"), [
    case if case in _POOLED_DEFAULT else pytest.param(*case, marks=pytest.mark.slow)
    for case in itertools.product(["pre", "post"], ["layernorm", "rmsnorm"], ["relu", "gelu", "gelu_tanh", "swiglu",
                                                                            "geglu"])
])
def test_pooled_logits_ignore_padding(norm, norm_type, activation):
    cfg = _ecfg(block=dict(norm=norm, norm_type=norm_type, activation=activation))
    params = _classifier_params(cfg)
    other = TOKENS.at[0, 4:].set(jnp.array([7, 10]))  # different ids at row 0's padded positions
    a, b = _logits(cfg, params), _logits(cfg, params, other)
    np.testing.assert_allclose(b, a, atol=1e-5)
    enc = lambda t: np.asarray(Encoder(cfg).apply({"params": params["encoder"]}, t, VALID))
    np.testing.assert_allclose(enc(other)[0, :4], enc(TOKENS)[0, :4], atol=1e-5)  # the stack's real outputs


def _pooled_logits(cfg, params, tokens, attend, pool) -> np.ndarray:
    """Classifier by hand, with separate attention and pooling masks: head(pool(Encoder(tokens)))."""
    h = Encoder(cfg).apply({"params": params["encoder"]}, tokens, attend)
    pooled = masked_mean(h, pool)
    return np.asarray(pooled @ params["head"]["kernel"] + params["head"]["bias"][None, :])


def test_padding_invariance_fails_without_either_mask():
    cfg = _ecfg()
    params = _classifier_params(cfg)
    other = TOKENS.at[0, 4:].set(jnp.array([7, 10]))
    everything = jnp.ones((N, L), bool)
    same = [_pooled_logits(cfg, params, t, VALID, VALID) for t in (TOKENS, other)]
    np.testing.assert_allclose(same[0], _logits(cfg, params), atol=1e-5)  # the Classifier is exactly this
    np.testing.assert_allclose(same[1], same[0], atol=1e-5)
    no_key_mask = [_pooled_logits(cfg, params, t, everything, VALID) for t in (TOKENS, other)]
    assert np.abs(no_key_mask[1][0] - no_key_mask[0][0]).max() > 1e-3
    # Without the pooling mask the padded positions' outputs (non-zero: they attend to real tokens) enter
    # the mean, so the logits depend on how much padding a row has.
    no_pool_mask = [_pooled_logits(cfg, params, t, VALID, everything) for t in (TOKENS, other)]
    assert np.abs(no_pool_mask[0][0] - same[0][0]).max() > 1e-3
    assert np.abs(no_pool_mask[1][0] - no_pool_mask[0][0]).max() > 1e-3  # and on the padded tokens' ids


# --- packed rows, fully masked rows ------------------------------------------------------------


def test_a_packed_row_equals_its_examples_run_separately():
    cfg = _ecfg()
    params = _classifier_params(cfg)
    first, second = [3, 1, 4], [5, 9]
    # Row 0 packs the two examples; row 1 is TOKENS' full row 1 (one segment), so the batch has the file's
    # shared [N=2, L=6] shape and reuses its compiled operations.
    packed = jnp.array([first + second + [0], TOKENS[1].tolist()], jnp.int32)
    seg = jnp.array([[0, 0, 0, 1, 1, 0], [0] * L], jnp.int32)
    valid = jnp.array([[True] * 5 + [False], [True] * L])
    alone = jnp.array([first + [0] * 3, second + [0] * 4], jnp.int32)
    alone_valid = jnp.array([[True] * 3 + [False] * 3, [True] * 2 + [False] * 4])
    enc = Encoder(cfg)
    h_packed = np.asarray(enc.apply({"params": params["encoder"]}, packed, valid, segment_ids=seg))
    h_alone = np.asarray(enc.apply({"params": params["encoder"]}, alone, alone_valid))
    np.testing.assert_allclose(h_packed[0, :3], h_alone[0, :3], atol=1e-5)
    np.testing.assert_allclose(h_packed[0, 3:5], h_alone[1, :2], atol=1e-5)  # positions restart per segment
    per_segment = _logits(cfg, params, packed, valid, segment_ids=seg, num_segments=2)  # [N, S, C]
    np.testing.assert_allclose(per_segment[0], _logits(cfg, params, alone, alone_valid), atol=1e-5)
    np.testing.assert_allclose(per_segment[1, 0], _logits(cfg, params)[1], atol=1e-5)  # one segment: the whole row


def test_fully_masked_row_gives_finite_logits():
    cfg = _ecfg()
    params = _classifier_params(cfg)
    valid = VALID.at[0].set(False)
    logits = _logits(cfg, params, TOKENS, valid)
    np.testing.assert_allclose(logits[0], np.asarray(params["head"]["bias"]), atol=1e-6)  # pooled zeros
    np.testing.assert_allclose(logits[1], _logits(cfg, params)[1], atol=1e-6)  # the other row is unaffected


@pytest.mark.slow
def test_fully_masked_row_gives_finite_classifier_gradients():
    # Attention- and block-level gradients of a fully masked row are checked in the default suite.
    cfg = _ecfg()
    params = _classifier_params(cfg)
    valid = VALID.at[0].set(False)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(Classifier(cfg).apply({"params": p}, TOKENS, valid) ** 2)))(params)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    assert np.abs(np.asarray(grads["encoder"]["embedding"])).max() > 0.0


def test_bfloat16_classifier_has_float32_logits_close_to_float32():
    cfg = _ecfg()
    params = _classifier_params(cfg)
    bf16 = cfg.model_copy(update={"block": cfg.block.model_copy(update={"dtype": "bfloat16"})})
    hidden = Encoder(bf16).apply({"params": params["encoder"]}, TOKENS, VALID)
    assert hidden.dtype == jnp.bfloat16
    low, ref = _logits(bf16, params), _logits(cfg, params)
    assert low.dtype == np.float32 and np.all(np.isfinite(low))
    np.testing.assert_allclose(low, ref, atol=0.05)  # logits O(1); seen: 0.006. bf16 keeps ~3 digits


def test_too_long_input_names_max_len():
    cfg = _ecfg()
    params = _classifier_params(cfg)
    tokens = jnp.zeros((1, 9), jnp.int32)
    with pytest.raises(ValueError, match=r"exceeds max_len=8: truncate inputs or raise model\.max_len"):
        Classifier(cfg).apply({"params": params}, tokens, jnp.ones((1, 9), bool))


def test_non_finite_padding_never_reaches_real_outputs_or_logits():
    """Padded ids outside [0, V) (the Encoder looks them up as id 0): real positions and pooled logits stay
    exact and finite."""
    cfg = _ecfg()  # the file's shared shapes: its eager operations are compiled already
    params = _classifier_params(cfg)
    enc = lambda t: np.asarray(Encoder(cfg).apply({"params": params["encoder"]}, t, VALID))
    poisoned_tokens = jnp.where(VALID, TOKENS, 99)  # out of range
    np.testing.assert_allclose(enc(poisoned_tokens)[np.asarray(VALID)], enc(TOKENS)[np.asarray(VALID)],
                               rtol=1e-6, atol=1e-6)
    poisoned = _logits(cfg, params, poisoned_tokens)
    assert np.all(np.isfinite(poisoned))
    np.testing.assert_allclose(poisoned, _logits(cfg, params), rtol=1e-6, atol=1e-6)


# --- the model is the formulas: plain JAX, every autodiff mode --------------------------------------------------


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_with_xla_attention_and_plain_gradients_the_stack_is_plain_jax_and_forward_mode_agrees(norm):
    """No custom derivative anywhere outside the kernels: with attention.kernel='xla' and gradients='plain' the
    whole stack's jaxpr holds none, and forward mode (jax.jvp) agrees with reverse mode. With gradients='auto'
    on a CPU the projection and LayerNorm kernels are there (jaxblock/kernels/), and reverse mode agrees."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(N, L, D)), jnp.float32)
    dx = jnp.asarray(rng.normal(size=(N, L, D)), jnp.float32)
    reverse = {}
    for gradients in ("plain", "auto"):
        cfg = StackConfig(num_layers=2, block={**BLOCK, "norm": norm, "gradients": gradients,
                                               "attention": {"kernel": "xla"}})
        model, params = EncoderStack(cfg), _stack_params(cfg)

        def f(x, model=model, params=params):
            return jnp.sum(jnp.sin(model.apply({"params": params}, x, VALID)))

        jaxpr = str(jax.make_jaxpr(f)(x))  # a custom VJP shows in the forward's jaxpr as custom_vjp_call
        assert ("custom_vjp" in jaxpr) == (gradients == "auto") and "custom_jvp" not in jaxpr
        reverse[gradients] = float(jnp.sum(jax.jit(jax.grad(f))(x) * dx))
        if gradients == "plain":
            tangent = jax.jit(lambda x, dx, f=f: jax.jvp(f, (x,), (dx,))[1])(x, dx)
            np.testing.assert_allclose(float(tangent), reverse["plain"], rtol=1e-4)
    np.testing.assert_allclose(reverse["auto"], reverse["plain"], rtol=1e-4)
