"""PyTorch interop: weights both ways with nn.TransformerEncoderLayer / nn.TransformerEncoder, proven on
outputs and gradients, sublayer by sublayer (float32: forward <= 1e-5 at real positions, gradients
<= 1e-4 relative per tensor)."""

import itertools
import subprocess
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the optional [torch] extra: pip install -e '.[torch]'")

from jaxblock import (  # noqa: E402
    BlockConfig,
    Classifier,
    EncoderBlock,
    EncoderConfig,
    EncoderStack,
    StackConfig,
    masks,
    unbox,
    unstack_layer_params,
)
from jaxblock.interop import torch as jt  # noqa: E402

nn = torch.nn
L = 7


@pytest.fixture(autouse=True)
def _torch_determinism():
    torch.manual_seed(0)
    torch.set_num_threads(2)


def _valid(lengths, length=L):
    return np.arange(length)[None, :] < np.asarray(lengths)[:, None]  # [N, L]


def _randomize(module):
    """PyTorch initializes norms to (1, 0) and attention biases to 0, which would hide a swapped or
    dropped mapping; give every norm and bias distinct values."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return module


def _layer(d, h, *, norm_first, activation="relu", bias=True, eps=1e-5, batch_first=True, dropout=0.1):
    layer = nn.TransformerEncoderLayer(
        d, h, 2 * d, dropout=dropout, activation=activation, layer_norm_eps=eps,
        batch_first=batch_first, norm_first=norm_first, bias=bias,
    )
    return _randomize(layer)


def _stack(d, h, num_layers, *, norm_first, final_norm=True, batch_first=True, bias=True):
    layer = nn.TransformerEncoderLayer(
        d, h, 2 * d, dropout=0.1, batch_first=batch_first, norm_first=norm_first, bias=bias
    )
    norm = nn.LayerNorm(d, bias=bias) if final_norm else None
    # TransformerEncoder deep-copies the layer; randomize afterwards so the copies differ.
    nested = batch_first and bias and not norm_first  # where PyTorch allows its nested-tensor fast path
    return _randomize(nn.TransformerEncoder(layer, num_layers, norm=norm, enable_nested_tensor=nested))


def _x(n, d, batch_first=True):
    return torch.randn(n, L, d) if batch_first else torch.randn(L, n, d)


def _masks(kind, n, h):
    """(valid_tokens, src_mask, is_causal) in PyTorch's conventions for one of the mask kinds."""
    valid = _valid([L, L - 2, 1][:n])
    rng = np.random.default_rng(1)
    ignore = rng.random((L, L)) < 0.3
    np.fill_diagonal(ignore, False)
    if kind == "padding":
        return valid, None, False
    if kind == "bool_src_mask":
        return valid, torch.from_numpy(ignore), False
    if kind == "float_src_mask":
        return valid, torch.from_numpy(np.where(ignore, -np.inf, 0.0).astype(np.float32)), False
    if kind == "per_example_src_mask":  # [N*H, L, L]: differs per example, repeated over heads
        per_example = rng.random((n, L, L)) < 0.3
        per_example[:, np.arange(L), np.arange(L)] = False
        return valid, torch.from_numpy(np.repeat(per_example, h, axis=0)), False
    if kind == "causal":
        return valid, None, True
    if kind == "causal_with_mask":  # the is_causal hint together with the causal mask it describes
        return valid, nn.Transformer.generate_square_subsequent_mask(L), True
    raise AssertionError(kind)


def _assert_parity(report, num_layers, num_params):
    checks = report.checks
    assert len(checks) == 6 * num_layers + 1 + 1 + num_params, str(report)
    assert {c.tol for c in checks if c.kind == "forward"} == {1e-5}
    assert {c.tol for c in checks if c.kind == "grad"} == {1e-4}
    assert report.ok, str(report)
    assert report.first_mismatch() is None
    assert str(report).endswith("all within tolerance")


# --- forward and gradient parity ----------------------------------------------------------------

# norm_first, activation, bias, eps, D, H, batch_first, masks, our attention kernel: every value of
# every factor appears in the six default cases (each compiles its own forward and backward pass); the
# second padding and causal cases, and the full product below, run under -m slow.
CASES = [
    (False, "relu", True, 1e-5, 32, 4, True, "padding", "unfused"),
    pytest.param(True, "gelu", True, 1e-6, 32, 2, False, "padding", "xla", marks=pytest.mark.slow),
    (False, "gelu", False, 1e-6, 24, 3, True, "bool_src_mask", "unfused"),
    (True, "relu", False, 1e-5, 16, 1, False, "float_src_mask", "xla"),
    (True, "gelu", True, 1e-5, 64, 8, True, "causal", "unfused"),
    pytest.param(False, "relu", False, 1e-6, 32, 4, False, "causal", "xla", marks=pytest.mark.slow),
    (True, "relu", True, 1e-6, 24, 6, True, "per_example_src_mask", "xla"),
    (False, "gelu", True, 1e-5, 16, 2, True, "causal_with_mask", "unfused"),
]


def _case_id(case: Any) -> str:
    return (case.values if hasattr(case, "values") else case)[7]


@pytest.mark.parametrize(
    "norm_first,activation,bias,eps,d,h,batch_first,mask_kind,attention", CASES, ids=[_case_id(c) for c in CASES]
)
def test_layer_forward_and_gradient_parity(norm_first, activation, bias, eps, d, h, batch_first, mask_kind, attention):
    layer = _layer(d, h, norm_first=norm_first, activation=activation, bias=bias, eps=eps, batch_first=batch_first)
    valid, src_mask, is_causal = _masks(mask_kind, 3, h)
    report = jt.compare(
        layer, _x(3, d, batch_first), valid, src_mask=src_mask, is_causal=is_causal, attention=attention
    )
    _assert_parity(report, num_layers=1, num_params=12 if bias else 6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "norm_first,activation,bias,eps,mask_kind",
    list(itertools.product(
        [False, True], ["relu", "gelu"], [True, False], [1e-5, 1e-6],
        ["padding", "bool_src_mask", "float_src_mask", "causal", "per_example_src_mask"],
    )),
)
def test_layer_parity_full_product(norm_first, activation, bias, eps, mask_kind):
    layer = _layer(32, 4, norm_first=norm_first, activation=activation, bias=bias, eps=eps)
    valid, src_mask, is_causal = _masks(mask_kind, 3, 4)
    report = jt.compare(layer, _x(3, 32), valid, src_mask=src_mask, is_causal=is_causal)
    _assert_parity(report, num_layers=1, num_params=12 if bias else 6)


@pytest.mark.parametrize("norm_first,batch_first", [(True, True), (False, False)])
def test_stack_of_four_with_final_norm(norm_first, batch_first):
    enc = _stack(16, 2, 4, norm_first=norm_first, batch_first=batch_first)
    cfg, _ = jt.from_torch(enc)
    assert cfg == StackConfig(num_layers=4, final_norm=True, block=cfg.block)
    report = jt.compare(enc, _x(3, 16, batch_first), _valid([L, 4, 2]))
    _assert_parity(report, num_layers=4, num_params=4 * 12 + 2)


def test_report_order_lookup_and_module_left_as_it_was():
    layer = _layer(16, 2, norm_first=True).train()
    layer.linear2.bias.requires_grad_(False)
    report = jt.compare(layer, _x(2, 16), _valid([L, 3]))
    assert layer.training  # compare ran it in eval mode and restored the mode
    assert not layer.linear2.bias.requires_grad and layer.linear1.weight.requires_grad
    assert all(p.grad is None for p in layer.parameters())
    names = [c.name for c in report.checks]
    assert names[:7] == ["norm1", "attn_branch", "after_attn", "norm2", "ffn_branch", "after_ffn", "output"]
    assert names[7] == "grad input"
    assert set(names[8:]) == {f"grad {k}" for k in layer.state_dict()}
    first_nonzero = next(c for c in report.checks if c.value > 0)
    assert report.first_mismatch(tol=0.0) == first_nonzero
    assert all(c.name in str(report) for c in report.checks)


def test_a_report_names_its_worst_check_and_its_first_mismatch():
    from jaxblock.interop.torch.parity import Check, ParityReport

    checks = (Check("norm1", "forward", 2e-6, 1e-5), Check("after_attn", "forward", 3e-5, 1e-5),
              Check("grad input", "grad", 5e-4, 1e-4), Check("grad w", "grad", 1e-7, 1e-4))
    report = ParityReport("hand-made", checks)
    assert not report.ok
    assert report.worst().name == "grad input"  # 5x its tolerance, against after_attn's 3x
    assert report.first_mismatch().name == "after_attn"  # the first over its tolerance, in execution order
    assert report.first_mismatch(tol=1e-3) is None and report.first_mismatch(tol=1e-6).name == "norm1"
    with_nan = ParityReport("nan", (*checks, Check("output", "forward", float("nan"), 1e-5)))
    assert with_nan.worst().name == "output"  # a non-finite value is worse than any finite one
    assert "first mismatch: after_attn" in str(report)


# --- padded positions ---------------------------------------------------------------------------


def test_padded_positions_fast_path_zeroes_slow_path_computes_like_ours():
    # post-LN + nested tensors: the fast path applies. No final norm: PyTorch applies it after turning the
    # nested result back into a zero-padded tensor, so padded positions would come out as the norm's bias.
    enc = _stack(16, 2, 2, norm_first=False, final_norm=False).eval()
    cfg, variables = jt.from_torch(enc)
    x = torch.randn(3, L, 16)
    valid = _valid([L, 3, 0])  # the last row is entirely padding
    kpm = torch.from_numpy(masks.to_torch_key_padding_mask(valid))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API in PyTorch
        fast = enc(x, src_key_padding_mask=kpm).numpy()
    with torch.enable_grad():  # autograd on: the slow path
        slow = enc(x.clone().requires_grad_(True), src_key_padding_mask=kpm).detach().numpy()
    ours = np.asarray(jax.jit(EncoderStack(cfg).apply)(variables, jnp.asarray(x.numpy()), jnp.asarray(valid)))

    np.testing.assert_allclose(fast[valid], slow[valid], atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours[valid], fast[valid], atol=1e-5, rtol=0)
    assert np.all(fast[~valid] == 0.0)  # fast path: padded positions, the fully padded row included, are 0
    assert np.all(np.abs(slow[~valid]).max(axis=-1) > 1e-2)  # slow path: computed, not zeroed
    np.testing.assert_allclose(ours, slow, atol=1e-5, rtol=0)  # ours computes them as the slow path does


def test_fully_padded_row_layer_fast_path_nan_ours_finite():
    layer = _layer(16, 2, norm_first=False).eval()
    cfg, variables = jt.from_torch(layer)
    x = torch.randn(2, L, 16)
    valid = _valid([4, 0])
    with torch.no_grad():  # eval + no autograd: the fused layer fast path
        fast = layer(x, src_key_padding_mask=torch.from_numpy(~valid)).numpy()
    ours = np.asarray(jax.jit(EncoderBlock(cfg).apply)(variables, jnp.asarray(x.numpy()), jnp.asarray(valid)))
    assert np.isnan(fast[1]).all()
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours[valid], fast[valid], atol=1e-5, rtol=0)
    # and the harness, on the slow path, stays finite for such a row in both forward and gradients
    assert jt.compare(layer, x, valid).ok


# --- per-sublayer location ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "norm_first,path,expected",
    [
        (True, ("layers_2", "ffn", "linear1", "kernel"), "layers_2/ffn_branch"),
        (True, ("layers_1", "self_attn", "query", "kernel"), "layers_1/attn_branch"),
        (False, ("layers_0", "ffn_norm", "scale"), "layers_0/norm2"),
        (False, ("layers_2", "attn_norm", "bias"), "layers_2/norm1"),
    ],
)
def test_perturbed_weight_is_located(norm_first, path, expected):
    enc = _stack(16, 2, 4, norm_first=norm_first)
    _, variables = jt.from_torch(enc)
    node = variables["params"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = node[path[-1]] + 1e-2  # the whole tensor: a single entry can sit behind a dead ReLU
    # the shapes and config of test_stack_of_four_with_final_norm: the compiled program is reused
    report = jt.compare(enc, _x(3, 16), _valid([L, 4, 2]), variables=variables)
    miss = report.first_mismatch()
    assert miss is not None and miss.name == expected, str(report)
    before = report.checks[: report.checks.index(miss)]
    assert before and all(c.ok for c in before)
    assert not report.ok and f"first mismatch: {expected}" in str(report)


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda: _layer(24, 3, norm_first=False, activation="gelu", eps=1e-6),
        lambda: _layer(16, 4, norm_first=True, bias=False, batch_first=False),
        lambda: _stack(16, 2, 3, norm_first=True),
        lambda: _stack(16, 2, 2, norm_first=False, final_norm=False, bias=False),
    ],
    ids=["layer", "layer_no_bias_seq_first", "stack_final_norm", "stack_no_norm"],
)
def test_to_torch_of_from_torch_reproduces_state_dict(build):
    m = build()
    first = m if isinstance(m, nn.TransformerEncoderLayer) else m.layers[0]
    back = jt.to_torch(*jt.from_torch(m), batch_first=first.self_attn.batch_first)
    assert type(back) is type(m)
    sd, sd_back = m.state_dict(), back.state_dict()
    assert list(sd_back) == list(sd)
    for k in sd:
        assert sd_back[k].dtype == sd[k].dtype and torch.equal(sd_back[k], sd[k]), k
    back_first = back if isinstance(back, nn.TransformerEncoderLayer) else back.layers[0]
    for attr in ("norm_first", "activation_relu_or_gelu"):
        assert getattr(back_first, attr) == getattr(first, attr)
    assert back_first.norm1.eps == first.norm1.eps and back_first.dropout.p == first.dropout.p


def _random_variables(model, x, seed):
    """The model's variable tree filled with distinct random values (no compiled init needed)."""
    shapes = unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.asarray(x), jnp.ones(x.shape[:2], bool)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), shapes)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_from_torch_of_to_torch_reproduces_block_variables():
    cfg = BlockConfig(
        model_dim=24, num_heads=3, ffn_dim=40, attention=dict(dropout=0.1), ffn_dropout=0.1, residual_dropout=0.1,
        norm="post", norm_eps=1e-6, activation="gelu", init="torch",
    )
    x = jnp.zeros((1, L, 24))
    variables = _random_variables(EncoderBlock(cfg), x, 0)
    cfg2, variables2 = jt.from_torch(jt.to_torch(cfg, variables))
    assert cfg2 == cfg
    _assert_trees_equal(variables2, variables)


def test_from_torch_of_to_torch_reproduces_scanned_stack():
    cfg = StackConfig(
        num_layers=3, final_norm=True, scan_layers=True,
        block=dict(model_dim=16, num_heads=2, ffn_dim=32, use_bias=False, activation="relu", init="torch"),
    )
    x = jnp.zeros((1, L, 16))
    variables = _random_variables(EncoderStack(cfg), x, 1)
    cfg2, variables2 = jt.from_torch(jt.to_torch(cfg, variables))
    assert cfg2 == cfg.model_copy(update={"scan_layers": False})
    _assert_trees_equal(variables2, unstack_layer_params(variables))


# --- causal and masks at call time --------------------------------------------------------------


@pytest.mark.parametrize("stack,with_mask", [(False, False), (True, True)], ids=["layer_causal", "stack_causal_mask"])
def test_torch_call_kwargs_reproduce_our_causal_call(with_mask, stack):
    block = BlockConfig(model_dim=16, num_heads=2, ffn_dim=32, init="torch", attention=dict(causal=True))
    cfg = StackConfig(num_layers=2, block=block) if stack else block
    model = EncoderStack(cfg) if stack else EncoderBlock(cfg)
    x = np.random.default_rng(0).standard_normal((2, L, 16)).astype(np.float32)
    valid = _valid([L, 5])
    attn_mask = ~np.eye(L, k=-1, dtype=bool) if with_mask else None  # forbid "previous token" too
    variables = _random_variables(model, x, 2)
    am = None if attn_mask is None else jnp.asarray(attn_mask)
    apply = jax.jit(lambda v, xs, vt: model.apply(v, xs, vt, attn_mask=am))
    ours = apply(variables, jnp.asarray(x), jnp.asarray(valid))
    bidirectional = block.model_copy(update={"attention": block.attention.model_copy(update={"causal": False})})
    torch_cfg = cfg.model_copy(update={"block": bidirectional}) if stack else bidirectional
    module = jt.to_torch(torch_cfg, variables).eval()
    kwargs = jt.torch_call_kwargs(module, valid, attn_mask, causal=True)
    assert kwargs["is_causal"] is (not with_mask)
    with torch.no_grad():
        theirs = module(torch.from_numpy(x), **kwargs).numpy()
    np.testing.assert_allclose(np.asarray(ours)[valid], theirs[valid], atol=1e-5, rtol=0)


def test_per_head_src_mask_must_agree_across_heads():
    per_head = np.zeros((2 * 4, L, L), bool)
    per_head[1, 0, 1] = True  # example 0, head 1 differs from head 0
    with pytest.raises(ValueError, match="differs across heads") as err:
        masks.from_torch_attn_mask(per_head, num_heads=4)
    assert "\n" not in str(err.value)
    same = np.repeat(np.random.default_rng(0).random((2, L, L)) < 0.5, 4, axis=0)
    np.testing.assert_array_equal(masks.from_torch_attn_mask(same, num_heads=4), ~same[::4])


# --- what cannot be converted -------------------------------------------------------------------


@pytest.mark.parametrize(
    "update,named",
    [
        ({"num_kv_heads": 2}, "num_kv_heads=2"),
        ({"attention": {"rope": True}}, "rope"),
        ({"norm_type": "rmsnorm"}, "rmsnorm"),
        ({"activation": "swiglu"}, "swiglu"),
        ({"activation": "gelu_tanh"}, "gelu_tanh"),
        ({"attention": {"dropout": 0.1}}, "dropout"),
        ({"attention": {"causal": True}}, "causal"),
        ({"ablate": "ffn"}, "ablate"),
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"attention": {"qkv_bias": False}}, "attention.qkv_bias=False with use_bias=True"),
        ({"use_bias": False, "attention": {"out_bias": True}}, "attention.out_bias=True with use_bias=False"),
    ],
)
def test_to_torch_rejects_what_torch_cannot_express(update, named):
    cfg = BlockConfig(**{"model_dim": 16, "num_heads": 4, "ffn_dim": 32, **update})
    with pytest.raises(ValueError, match=named) as err:
        jt.to_torch(cfg, {})
    assert "\n" not in str(err.value) and "no nn.TransformerEncoderLayer equivalent" in str(err.value)


def test_to_torch_rejects_mismatched_variables():
    cfg = BlockConfig(model_dim=16, num_heads=4, ffn_dim=32)
    variables = unbox(jax.eval_shape(EncoderBlock(cfg.model_copy(update={"ffn_dim": 48})).init,
                                     jax.random.key(0), jnp.zeros((1, 3, 16)), jnp.ones((1, 3), bool)))
    variables = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), variables)
    with pytest.raises(ValueError, match=r"linear1\.weight shape \(48, 16\), the config needs \(32, 16\)") as err:
        jt.to_torch(cfg, variables)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "activation,name",
    [("relu", "relu"), ("gelu", "gelu"), (torch.nn.functional.gelu, "gelu"), (nn.ReLU(), "relu"), (nn.GELU(), "gelu")],
)
def test_activation_mapping(activation, name):
    assert jt.from_torch(_layer(8, 2, norm_first=True, activation=activation))[0].activation == name


def _bad_modules():
    silu = _layer(8, 2, norm_first=True, activation=torch.nn.functional.silu)
    tanh = _layer(8, 2, norm_first=True, activation=nn.GELU(approximate="tanh"))
    rates = _layer(8, 2, norm_first=True)
    rates.dropout1.p = 0.3
    eps = nn.TransformerEncoder(_layer(8, 2, norm_first=True), 2, nn.LayerNorm(8, eps=1e-3),
                                enable_nested_tensor=False)
    return [
        (silu, ValueError, "activation .* has no jaxblock equivalent"),
        (tanh, ValueError, "approximate='tanh'"),
        (rates, ValueError, "dropout rates differ"),
        (eps, ValueError, "final norm"),
        (_layer(8, 2, norm_first=True).double(), ValueError, "float64"),
        (nn.Linear(8, 8), TypeError, "got Linear"),
    ]


@pytest.mark.parametrize("index", range(6))
def test_from_torch_rejects_with_one_line(index):
    module, exc, pattern = _bad_modules()[index]
    with pytest.raises(exc, match=pattern) as err:
        jt.from_torch(module)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"x": np.zeros((2, L, 8))}, r"x has shape \(2, 7, 8\); the module takes \[N, L, D\] with D=16"),
        ({"valid_tokens": np.ones((2, L + 1), bool)}, r"valid_tokens has shape \(2, 8\), x needs \[N, L\]"),
        ({"attention": "flash"}, "attention.kernel: Input should be"),
        ({"dtype": "float64"}, "dtype: Input should be"),
    ],
)
def test_compare_rejects_bad_input_with_one_line(kwargs, pattern):
    call = {"x": np.zeros((2, L, 16), np.float32)} | kwargs
    with pytest.raises(ValueError, match=pattern) as err:
        jt.compare(_layer(16, 2, norm_first=True), **call)
    assert "\n" not in str(err.value)


# --- a whole classifier built from standard PyTorch modules -------------------------------------


class TorchClassifier(nn.Module):
    """Embedding + learned positions + Pre-LN TransformerEncoder with final norm + masked mean + head."""

    def __init__(self, vocab, max_len, d, h, layers, classes):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, d))
        layer = nn.TransformerEncoderLayer(d, h, 2 * d, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens, valid):
        x = self.embedding(tokens) + self.pos[: tokens.shape[1]][None]
        h = self.encoder(x, src_key_padding_mask=~valid)
        w = valid.to(h.dtype)[..., None]
        return self.head((h * w).sum(1) / w.sum(1).clamp(min=1.0))


def test_classifier_logits_and_cross_entropy_gradients():
    vocab, max_len, d, classes = 50, 12, 16, 3
    tm = TorchClassifier(vocab, max_len, d, 2, 2, classes)
    _randomize(tm).eval()
    stack_cfg, stack_vars = jt.from_torch(tm.encoder)
    cfg = EncoderConfig(num_layers=2, final_norm=True, block=stack_cfg.block, vocab_size=vocab,
                        max_len=max_len, embedding=dict(positions="learned"), num_classes=classes)
    params = {
        "encoder": {
            "embedding": jnp.asarray(tm.embedding.weight.detach().numpy()),  # [V, D]
            "pos_embedding": jnp.asarray(tm.pos.detach().numpy()),  # [max_len, D]
            "stack": stack_vars["params"],
        },
        "head": {
            "kernel": jnp.asarray(tm.head.weight.detach().numpy().T),  # [D, C]
            "bias": jnp.asarray(tm.head.bias.detach().numpy()),
        },
    }
    model = Classifier(cfg)
    tokens = np.random.default_rng(0).integers(0, vocab, (4, L)).astype(np.int32)
    valid = _valid([L, 5, 2, 1])
    labels = np.array([0, 2, 1, 2], np.int32)
    # the converted tree has exactly the Classifier's structure
    ref = unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.asarray(tokens), jnp.asarray(valid)))["params"]
    assert jax.tree.structure(ref) == jax.tree.structure(params)

    def loss_fn(p):
        logits = model.apply({"params": p}, jnp.asarray(tokens), jnp.asarray(valid))
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels)).mean(), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    t_logits = tm(torch.from_numpy(tokens).long(), torch.from_numpy(valid))
    t_loss = torch.nn.functional.cross_entropy(t_logits, torch.from_numpy(labels).long())
    t_grads = dict(zip([n for n, _ in tm.named_parameters()],
                       torch.autograd.grad(t_loss, list(tm.parameters())), strict=True))

    np.testing.assert_allclose(np.asarray(logits), t_logits.detach().numpy(), atol=1e-5, rtol=0)
    assert abs(float(loss) - t_loss.item()) <= 1e-5
    ours = {f"encoder.{k}": v for k, v in jt.params_to_state_dict(stack_cfg, grads["encoder"]["stack"]).items()}
    ours |= {
        "embedding.weight": np.asarray(grads["encoder"]["embedding"]),
        "pos": np.asarray(grads["encoder"]["pos_embedding"]),
        "head.weight": np.asarray(grads["head"]["kernel"]).T,
        "head.bias": np.asarray(grads["head"]["bias"]),
    }
    assert set(ours) == set(t_grads)
    for name, g in t_grads.items():
        g = g.numpy()
        assert np.linalg.norm(g) > 0, name
        assert np.linalg.norm(ours[name] - g) / np.linalg.norm(g) <= 1e-4, name


# --- bfloat16 -----------------------------------------------------------------------------------


def test_bfloat16_block_within_documented_tolerance():
    layer = _layer(32, 4, norm_first=True, activation="gelu")
    report = jt.compare(layer, _x(3, 32), _valid([L, 4, 2]), dtype="bfloat16")
    forward_tol, grad_tol = jt.TOLERANCES["bfloat16"]
    assert (forward_tol, grad_tol) == (6e-2, 2e-2)
    assert {c.tol for c in report.checks if c.kind == "forward"} == {forward_tol}
    assert {c.tol for c in report.checks if c.kind == "grad"} == {grad_tol}
    assert report.ok, str(report)
    # it really ran in bfloat16: far from float32 agreement
    assert max(c.value for c in report.checks if c.kind == "forward") > 1e-3


# --- optional dependency ------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess; tests/jaxblock/interop/test_hf.py's slow twin checks transformers too
def test_importing_jaxblock_does_not_import_torch():
    code = "import sys, jaxblock, jaxblock.interop; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
