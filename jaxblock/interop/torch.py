"""Weights to and from torch.nn.TransformerEncoderLayer / nn.TransformerEncoder, and a parity harness.

Shapes: N batch, L length, D width, H heads, K = D / H, F FFN width. Our modules always take
x [N, L, D]; a PyTorch module built with batch_first=False takes [L, N, D].

Parameter mapping (PyTorch name -> ours; PyTorch's nn.Linear computes x @ weight.T + bias):

    self_attn.in_proj_weight [3D, D], rows q | k | v   -> self_attn/{query,key,value}/kernel [D, H, K]
    self_attn.in_proj_bias [3D]                         -> self_attn/{query,key,value}/bias [H, K]
    self_attn.out_proj.weight [D, D], .bias [D]         -> self_attn/out/kernel [H, K, D], bias [D]
    linear1.weight [F, D], linear2.weight [D, F]        -> ffn/linear1/kernel [D, F], ffn/linear2/kernel [F, D]
    norm1.weight, norm1.bias / norm2.*                  -> attn_norm/{scale,bias} / ffn_norm/{scale,bias}
    (TransformerEncoder) layers.i.* / norm.*            -> layers_i/* / final_norm/*

Causal attention is a call-time argument in PyTorch (`is_causal=True` plus a causal `src_mask`),
not a module attribute, so `from_torch` returns causal=False and `to_torch` refuses causal=True;
`torch_call_kwargs` builds the masks that reproduce our call on the PyTorch module.

Padded positions: PyTorch's TransformerEncoder fast path (eval, no autograd, norm_first=False,
batch_first, enable_nested_tensor=True, a key_padding_mask) runs on nested tensors and returns 0 at
padded positions, a fully padded row included (its final norm, if any, then maps those zeros to the
norm's bias); its slow path computes padded positions exactly as ours do. The layer's own fused fast
path (one TransformerEncoderLayer, eval, no autograd) returns NaN for a fully padded row; ours is
finite there. Parity is therefore measured at real positions only.

Importing this module imports torch; importing `jaxblock` does not.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from pydantic import ValidationError
from torch.nn import functional

from jaxblock import masks
from jaxblock.block import RECORDED_SITES, EncoderBlock
from jaxblock.config import BlockConfig, StackConfig, format_validation_error
from jaxblock.model import EncoderStack, unstack_layer_params

# (forward max abs diff at real positions, relative L2 gradient error) by our compute dtype.
# Half precision against PyTorch in float32, one block, D <= 64, x ~ N(0, 1): measured worst cases are
# bfloat16 2.4e-2 forward / 8e-3 gradient, float16 3e-3 / 1e-3; the bounds leave 2-3x headroom.
# With ReLU, a bfloat16 hidden unit rounded across 0 flips its gradient: expect up to ~1e-1 there.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (6e-2, 2e-2), "float16": (6e-3, 3e-3)}

_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPES_TORCH = {v: k for k, v in _TORCH_DTYPES.items()}


# --- configs ------------------------------------------------------------------------------------


def _activation_name(activation: Any) -> str:
    if activation is functional.relu or isinstance(activation, torch.nn.ReLU):
        return "relu"
    if activation is functional.gelu or (isinstance(activation, torch.nn.GELU) and activation.approximate == "none"):
        return "gelu"
    raise ValueError(
        f"activation {activation!r} has no jaxblock equivalent: build the layer with activation='relu' or 'gelu'"
    )


def _layer_config(layer: torch.nn.TransformerEncoderLayer) -> BlockConfig:
    attn = layer.self_attn
    if not attn._qkv_same_embed_dim or attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError("self_attn uses kdim/vdim, add_bias_kv or add_zero_attn: jaxblock has none of these")
    rates = {attn.dropout, layer.dropout.p, layer.dropout1.p, layer.dropout2.p}
    if len(rates) > 1:
        raise ValueError(
            f"dropout rates differ inside the layer ({sorted(rates)}): set one rate, as the constructor does"
        )
    if layer.norm1.eps != layer.norm2.eps:
        raise ValueError(f"norm1.eps={layer.norm1.eps} differs from norm2.eps={layer.norm2.eps}: set one eps")
    biases = [attn.in_proj_bias, attn.out_proj.bias, layer.linear1.bias, layer.linear2.bias,
              layer.norm1.bias, layer.norm2.bias]
    use_bias = biases[0] is not None
    if any((b is not None) != use_bias for b in biases):
        raise ValueError("the layer mixes biased and bias-free sublayers: jaxblock's use_bias governs every bias")
    if layer.norm1.weight is None or layer.norm2.weight is None:
        raise ValueError("a norm has no weight (elementwise_affine=False): jaxblock's LayerNorm always has a scale")
    dtype = _TORCH_DTYPES.get(attn.in_proj_weight.dtype)
    if dtype is None:
        raise ValueError(f"parameters are {attn.in_proj_weight.dtype}: convert with module.float() first")
    return BlockConfig(
        model_dim=attn.embed_dim, num_heads=attn.num_heads, ffn_dim=layer.linear1.out_features,
        attn_dropout=attn.dropout, ffn_dropout=attn.dropout, residual_dropout=attn.dropout,
        norm="pre" if layer.norm_first else "post", norm_eps=layer.norm1.eps,
        activation=_activation_name(layer.activation), use_bias=use_bias,
        dtype=dtype, param_dtype=dtype, init="torch",
    )


def _check_expressible(cfg: BlockConfig) -> None:
    """One-line ValueError naming the first field nn.TransformerEncoderLayer cannot express."""
    rates = {cfg.attn_dropout, cfg.ffn_dropout, cfg.residual_dropout}
    problems = [
        (cfg.kv_heads != cfg.num_heads, f"num_kv_heads={cfg.num_kv_heads} (GQA/MQA)", "leave num_kv_heads unset"),
        (cfg.rope, "rope=True", "use learned or sinusoidal positions"),
        (cfg.norm_type != "layernorm", f"norm_type='{cfg.norm_type}'", "use norm_type='layernorm'"),
        (cfg.is_glu, f"activation='{cfg.activation}' (gated FFN)", "use 'relu' or 'gelu'"),
        (cfg.activation == "gelu_tanh", "activation='gelu_tanh'", "use exact 'gelu'"),
        (len(rates) > 1, f"differing dropout rates {sorted(rates)}", "set attn/ffn/residual dropout equal"),
        (cfg.ablate != "none", f"ablate='{cfg.ablate}'", "use ablate='none'"),
        (cfg.dtype != cfg.param_dtype, f"dtype='{cfg.dtype}' with param_dtype='{cfg.param_dtype}'",
         "set dtype equal to param_dtype (use torch.autocast for mixed precision)"),
        (cfg.causal, "causal=True (PyTorch takes is_causal at call time)",
         "convert with causal=False and call with torch_call_kwargs(..., causal=True)"),
    ]
    for bad, what, fix in problems:
        if bad:
            raise ValueError(f"{what} has no nn.TransformerEncoderLayer equivalent: {fix}")


# --- parameter mapping --------------------------------------------------------------------------


def _f32(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().float().numpy()
    return np.asarray(a, np.float32)


def _block_state_dict(cfg: BlockConfig, p: Any, prefix: str = "") -> dict[str, np.ndarray]:
    d = cfg.model_dim
    a = p["self_attn"]
    sd = {
        "self_attn.in_proj_weight": np.concatenate(
            [_f32(a[n]["kernel"]).reshape(d, d).T for n in ("query", "key", "value")]
        ),  # [3D, D]
        "self_attn.out_proj.weight": _f32(a["out"]["kernel"]).reshape(d, d).T,  # [H, K, D] -> [D, H*K]
        "linear1.weight": _f32(p["ffn"]["linear1"]["kernel"]).T,  # [F, D]
        "linear2.weight": _f32(p["ffn"]["linear2"]["kernel"]).T,  # [D, F]
        "norm1.weight": _f32(p["attn_norm"]["scale"]),
        "norm2.weight": _f32(p["ffn_norm"]["scale"]),
    }
    if cfg.use_bias:
        sd["self_attn.in_proj_bias"] = np.concatenate(
            [_f32(a[n]["bias"]).reshape(d) for n in ("query", "key", "value")]
        )
        sd["self_attn.out_proj.bias"] = _f32(a["out"]["bias"])
        sd["linear1.bias"] = _f32(p["ffn"]["linear1"]["bias"])
        sd["linear2.bias"] = _f32(p["ffn"]["linear2"]["bias"])
        sd["norm1.bias"] = _f32(p["attn_norm"]["bias"])
        sd["norm2.bias"] = _f32(p["ffn_norm"]["bias"])
    return {prefix + k: v for k, v in sd.items()}


def _block_params(cfg: BlockConfig, sd: dict[str, np.ndarray], prefix: str = "") -> dict[str, Any]:
    d, h, k = cfg.model_dim, cfg.num_heads, cfg.head_dim
    dt = cfg.params_dtype

    def get(name: str) -> np.ndarray:
        return sd[prefix + name]

    def with_bias(kernel: np.ndarray, bias_name: str, shape: tuple[int, ...]) -> dict[str, jax.Array]:
        out = {"kernel": jnp.asarray(kernel, dt)}
        return out | ({"bias": jnp.asarray(get(bias_name).reshape(shape), dt)} if cfg.use_bias else {})

    def norm(name: str) -> dict[str, jax.Array]:
        out = {"scale": jnp.asarray(get(f"{name}.weight"), dt)}
        return out | ({"bias": jnp.asarray(get(f"{name}.bias"), dt)} if cfg.use_bias else {})

    w_qkv = np.split(get("self_attn.in_proj_weight"), 3)  # 3 x [D, D], rows = output features
    attn = {
        n: {"kernel": jnp.asarray(w.T.reshape(d, h, k), dt)}  # [D, H, K]
        for n, w in zip(("query", "key", "value"), w_qkv, strict=True)
    }
    if cfg.use_bias:
        for n, b in zip(("query", "key", "value"), np.split(get("self_attn.in_proj_bias"), 3), strict=True):
            attn[n]["bias"] = jnp.asarray(b.reshape(h, k), dt)
    attn["out"] = with_bias(get("self_attn.out_proj.weight").T.reshape(h, k, d), "self_attn.out_proj.bias", (d,))
    return {
        "attn_norm": norm("norm1"),
        "self_attn": attn,
        "ffn_norm": norm("norm2"),
        "ffn": {
            "linear1": with_bias(get("linear1.weight").T, "linear1.bias", (cfg.ffn_dim,)),  # [D, F]
            "linear2": with_bias(get("linear2.weight").T, "linear2.bias", (d,)),  # [F, D]
        },
    }


def _params_of(variables: Any) -> Any:
    """Plain per-layer params from {'params': ...} or a bare tree; boxed, stacked or nested trees accepted."""
    p = nn.unbox(variables)
    p = p.get("params", p)
    for outer in ("encoder", "stack"):  # a Classifier's or Encoder's tree holds the stack inside
        p = p.get(outer, p)
    return unstack_layer_params(p)


def params_to_state_dict(config: BlockConfig | StackConfig, variables: Any) -> dict[str, np.ndarray]:
    """Our params (or gradients, the map is linear) -> PyTorch state-dict names, float32 numpy."""
    p = _params_of(variables)
    try:
        if isinstance(config, BlockConfig):
            return _block_state_dict(config, p)
        sd: dict[str, np.ndarray] = {}
        for i in range(config.num_layers):
            sd |= _block_state_dict(config.block, p[f"layers_{i}"], f"layers.{i}.")
        if config.has_final_norm:
            sd["norm.weight"] = _f32(p["final_norm"]["scale"])
            if config.block.use_bias:
                sd["norm.bias"] = _f32(p["final_norm"]["bias"])
        return sd
    except KeyError as err:
        raise ValueError(
            f"variables lack {err} that the config requires: pass the variables built for this config"
        ) from None


def state_dict_to_params(config: BlockConfig | StackConfig, state_dict: dict[str, Any]) -> dict[str, Any]:
    """PyTorch state dict (tensors or arrays) -> our plain params tree, in config.param_dtype."""
    sd = {k: _f32(v) for k, v in state_dict.items()}
    if isinstance(config, BlockConfig):
        return _block_params(config, sd)
    p = {f"layers_{i}": _block_params(config.block, sd, f"layers.{i}.") for i in range(config.num_layers)}
    if config.has_final_norm:
        dt = config.block.params_dtype
        p["final_norm"] = {"scale": jnp.asarray(sd["norm.weight"], dt)}
        if config.block.use_bias:
            p["final_norm"]["bias"] = jnp.asarray(sd["norm.bias"], dt)
    return p


# --- conversion ---------------------------------------------------------------------------------


def from_torch(module: torch.nn.Module) -> tuple[BlockConfig | StackConfig, dict[str, Any]]:
    """nn.TransformerEncoderLayer -> (BlockConfig, variables) for EncoderBlock;
    nn.TransformerEncoder -> (StackConfig, variables) for EncoderStack.

    Fields PyTorch has no notion of keep their defaults (attention kernel, fused_qkv), init is 'torch'
    and causal is False (PyTorch decides it per call). batch_first only changes the layout PyTorch
    expects; ours is always [N, L, D].
    """
    if isinstance(module, torch.nn.TransformerEncoderLayer):
        cfg: BlockConfig | StackConfig = _layer_config(module)
    elif isinstance(module, torch.nn.TransformerEncoder):
        layers = list(module.layers)
        block = _layer_config(layers[0])
        for i, layer in enumerate(layers[1:], 1):
            if _layer_config(layer) != block:
                raise ValueError(f"layers.{i} is configured unlike layers.0: jaxblock stacks identical blocks")
        norm = module.norm
        if norm is not None and not (
            isinstance(norm, torch.nn.LayerNorm) and tuple(norm.normalized_shape) == (block.model_dim,)
            and norm.eps == block.norm_eps and (norm.bias is not None) == block.use_bias and norm.weight is not None
        ):
            raise ValueError(
                f"final norm {norm!r} is not a LayerNorm({block.model_dim}) with the layers' eps and bias: "
                "use nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)"
            )
        cfg = StackConfig(num_layers=len(layers), final_norm=norm is not None, block=block)
    else:
        raise TypeError(
            f"from_torch takes nn.TransformerEncoderLayer or nn.TransformerEncoder, got {type(module).__name__}: "
            "convert embeddings and heads with a plain mapping"
        )
    return cfg, {"params": state_dict_to_params(cfg, module.state_dict())}


def to_torch(
    config: BlockConfig | StackConfig,
    variables: Any,
    *,
    batch_first: bool = True,
    enable_nested_tensor: bool = False,
) -> torch.nn.Module:
    """(BlockConfig, variables) -> nn.TransformerEncoderLayer; (StackConfig, variables) -> nn.TransformerEncoder.

    Weights are copied, so the config's init scheme does not matter. batch_first=True matches our
    [N, L, D] layout. enable_nested_tensor defaults to False so padded positions are computed as ours are
    (the nested fast path zeroes them; real positions agree either way).
    A config PyTorch cannot express raises a one-line ValueError naming the field.
    """
    block = config if isinstance(config, BlockConfig) else config.block
    _check_expressible(block)
    layer = torch.nn.TransformerEncoderLayer(
        block.model_dim, block.num_heads, block.ffn_dim, dropout=block.attn_dropout, activation=block.activation,
        layer_norm_eps=block.norm_eps, batch_first=batch_first, norm_first=block.norm == "pre",
        bias=block.use_bias, dtype=_DTYPES_TORCH[block.param_dtype],
    )
    module: torch.nn.Module = layer
    if isinstance(config, StackConfig):
        norm = None
        if config.has_final_norm:
            norm = torch.nn.LayerNorm(
                block.model_dim, eps=block.norm_eps, bias=block.use_bias, dtype=_DTYPES_TORCH[block.param_dtype]
            )
        module = torch.nn.TransformerEncoder(
            layer, config.num_layers, norm=norm, enable_nested_tensor=enable_nested_tensor and block.norm == "post"
        )
    sd = params_to_state_dict(config, variables)
    expected = module.state_dict()
    for name, ref in expected.items():
        got = sd.get(name)
        if got is None or tuple(got.shape) != tuple(ref.shape):
            shape = None if got is None else tuple(got.shape)
            raise ValueError(
                f"variables give {name} shape {shape}, the config needs {tuple(ref.shape)}: "
                "pass the variables built for this config"
            )
    module.load_state_dict({k: torch.tensor(v, dtype=expected[k].dtype) for k, v in sd.items()}, strict=True)
    return module


def torch_call_kwargs(
    module: torch.nn.Module,
    valid_tokens: Any = None,
    attn_mask: Any = None,
    causal: bool = False,
) -> dict[str, Any]:
    """Our call's masks (True = attend; `causal` from the config) -> keyword arguments for the PyTorch module."""
    kw: dict[str, Any] = {}
    if valid_tokens is not None:
        kw["src_key_padding_mask"] = torch.from_numpy(masks.to_torch_key_padding_mask(valid_tokens).copy())
    allowed = None if attn_mask is None else np.asarray(attn_mask, bool)
    if causal:
        if valid_tokens is None and allowed is None:
            raise ValueError("causal=True needs valid_tokens or attn_mask to know the length: pass valid_tokens")
        length = np.shape(valid_tokens if valid_tokens is not None else attn_mask)[-1]
        tril = np.tril(np.ones((length, length), bool))
        allowed = tril if allowed is None else allowed & tril
        kw["is_causal"] = attn_mask is None  # PyTorch's hint must mean "the mask is exactly causal"
    if allowed is not None:
        name = "mask" if isinstance(module, torch.nn.TransformerEncoder) else "src_mask"
        kw[name] = torch.from_numpy(masks.to_torch_attn_mask(allowed).copy())
    return kw


# --- parity harness -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One comparison: 'forward' = max |ours - torch| at real positions; 'grad' = ||g_o - g_t|| / ||g_t||
    (the absolute ||g_o - g_t|| when PyTorch's gradient is exactly 0)."""

    name: str
    kind: str
    value: float
    tol: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.value) and self.value <= self.tol

    @property
    def ratio(self) -> float:
        return self.value / self.tol if math.isfinite(self.value) else math.inf


@dataclass(frozen=True)
class ParityReport:
    """Forward checks in execution order (per layer: its sublayers), then `output`, then gradients."""

    title: str
    checks: tuple[Check, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def worst(self) -> Check:
        """The check furthest over (or closest to) its tolerance."""
        return max(self.checks, key=lambda c: c.ratio)

    def first_mismatch(self, tol: float | None = None) -> Check | None:
        """The first check, in execution order, above `tol` (default: its own tolerance); None if all pass."""
        for c in self.checks:
            if not (math.isfinite(c.value) and c.value <= (c.tol if tol is None else tol)):
                return c
        return None

    def __str__(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [self.title, f"{'check':<{width}}  {'measure':<17}  {'value':>9}  {'tol':>7}  ok"]
        for c in self.checks:
            measure = "max|diff| real" if c.kind == "forward" else "rel L2 error"
            lines.append(f"{c.name:<{width}}  {measure:<17}  {c.value:9.2e}  {c.tol:7.0e}  {'ok' if c.ok else 'FAIL'}")
        miss = self.first_mismatch()
        lines.append("all within tolerance" if miss is None else f"first mismatch: {miss.name}")
        return "\n".join(lines)


def compare(
    module: torch.nn.Module,
    x: Any,
    valid_tokens: Any = None,
    *,
    src_mask: Any = None,
    is_causal: bool = False,
    attention: str = "unfused",
    dtype: str | None = None,
    seed: int = 0,
    variables: Any = None,
    forward_tol: float | None = None,
    grad_tol: float | None = None,
) -> ParityReport:
    """Run the PyTorch module (eval, slow path, autograd on) and ours on its converted weights; report
    max |diff| per recorded intermediate and the output at real positions, and the relative gradient
    error of the input and every parameter for loss = sum over real positions of output * fixed random
    weights (drawn from `seed`).

    x: the module's own layout ([N, L, D], or [L, N, D] when batch_first=False). valid_tokens: bool[N, L],
    True = real (default: all real). src_mask: PyTorch's ([L, L] or [N*H, L, L], bool True = ignore or
    additive float). is_causal: as PyTorch's; a causal src_mask is built when none is given.
    attention: our kernel ('unfused' or 'xla'); dtype: our compute dtype (default: the module's).
    variables: our params to test instead of the module's converted weights (same config).
    The module's train mode and requires_grad flags are restored afterwards; its .grad is untouched.
    """
    cfg, converted = from_torch(module)
    variables = {"params": _params_of(variables if variables is not None else converted)}
    block = cfg if isinstance(cfg, BlockConfig) else cfg.block
    try:  # validated copy: a misspelt kernel or dtype fails here, naming the field
        block = BlockConfig.model_validate(
            block.model_dump() | {"attention": attention, "causal": is_causal, "dtype": dtype or block.dtype}
        )
    except ValidationError as err:
        raise ValueError(format_validation_error(err)) from None
    ours_cfg = block if isinstance(cfg, BlockConfig) else cfg.model_copy(update={"block": block})
    layers = _torch_layers(module)
    batch_first = bool(layers[0].self_attn.batch_first)
    ftol, gtol = TOLERANCES[block.dtype if block.dtype != "float32" else block.param_dtype]  # the lower precision
    ftol = ftol if forward_tol is None else forward_tol
    gtol = gtol if grad_tol is None else grad_tol

    x_np = _f32(x)
    if x_np.ndim != 3 or x_np.shape[-1] != block.model_dim:
        layout = "[N, L, D]" if batch_first else "[L, N, D] (batch_first=False)"
        raise ValueError(f"x has shape {x_np.shape}; the module takes {layout} with D={block.model_dim}: pass that")
    x_nld = x_np if batch_first else x_np.transpose(1, 0, 2)  # [N, L, D]
    n, length, _ = x_nld.shape
    valid = np.ones((n, length), bool) if valid_tokens is None else np.asarray(valid_tokens, bool)
    if valid.shape != (n, length):
        raise ValueError(f"valid_tokens has shape {valid.shape}, x needs [N, L] = {(n, length)}: one bool per token")
    loss_w = np.random.default_rng(seed).standard_normal(x_nld.shape).astype(np.float32) * valid[..., None]
    attn_mask = None
    if src_mask is not None:
        raw = src_mask.detach().cpu().numpy() if isinstance(src_mask, torch.Tensor) else np.asarray(src_mask)
        attn_mask = masks.from_torch_attn_mask(raw, num_heads=block.num_heads)  # [L, L] or [N, L, L]

    t_out, t_mid, t_grads = _run_torch(module, layers, x_np, valid if valid_tokens is not None else None,
                                       src_mask, is_causal, loss_w, batch_first)
    o_out, o_mid, o_grads = _run_ours(ours_cfg, variables, x_nld, valid, attn_mask, loss_w)
    o_sd = params_to_state_dict(ours_cfg, {"params": o_grads[0]})

    def to_nld(a: np.ndarray) -> np.ndarray:
        return a if batch_first else a.transpose(1, 0, 2)

    def fwd(name: str, ours: np.ndarray, theirs: np.ndarray) -> Check:
        diff = np.abs(ours.astype(np.float32) - to_nld(theirs))[valid]
        return Check(name, "forward", float(diff.max()) if diff.size else 0.0, ftol)

    def rel(name: str, ours: np.ndarray, theirs: np.ndarray) -> Check:
        ref = float(np.linalg.norm(theirs))
        return Check(name, "grad", float(np.linalg.norm(ours - theirs)) / (ref if ref > 0 else 1.0), gtol)

    checks = []
    for i, layer in enumerate(layers):
        prefix = "" if isinstance(cfg, BlockConfig) else f"layers_{i}/"
        mids = o_mid if isinstance(cfg, BlockConfig) else o_mid[f"layers_{i}"]
        for site in RECORDED_SITES["pre" if layer.norm_first else "post"]:
            checks.append(fwd(prefix + site, np.asarray(mids[site][0]), t_mid[i][site]))
    checks.append(fwd("output", o_out, t_out))
    checks.append(rel("grad input", o_grads[1], to_nld(t_grads.pop("input"))))
    checks += [rel(f"grad {name}", o_sd[name], g) for name, g in t_grads.items()]
    kind = type(module).__name__ + ("" if isinstance(cfg, BlockConfig) else f" x{cfg.num_layers}")
    title = (f"PyTorch parity: {kind}, {block.norm}-LN, ours {block.dtype} attention='{attention}', "
             f"PyTorch {block.param_dtype} slow path; {int(valid.sum())} real positions")
    return ParityReport(title, tuple(checks))


def _torch_layers(module: torch.nn.Module) -> list[torch.nn.TransformerEncoderLayer]:
    if isinstance(module, torch.nn.TransformerEncoder):
        return [layer for layer in module.layers if isinstance(layer, torch.nn.TransformerEncoderLayer)]
    if isinstance(module, torch.nn.TransformerEncoderLayer):
        return [module]
    raise TypeError(f"compare takes nn.TransformerEncoderLayer or nn.TransformerEncoder, got {type(module).__name__}")


def _run_torch(
    module: torch.nn.Module, layers: list[Any], x: np.ndarray, valid: np.ndarray | None, src_mask: Any,
    is_causal: bool, loss_w: np.ndarray, batch_first: bool,
) -> tuple[np.ndarray, list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Forward with hooks recording each sublayer (hooks and autograd keep PyTorch on its slow path)."""
    param_dtype = next(module.parameters()).dtype
    mids: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    hooks = []

    def keep(store: dict[str, torch.Tensor], name: str, use_input: bool) -> Callable[..., None]:
        def hook(mod: Any, args: Any, out: Any) -> None:
            store[name] = args[0] if use_input else out

        return hook

    for store, layer in zip(mids, layers, strict=True):
        sites = [(layer.dropout1, "attn_branch", False), (layer.dropout2, "ffn_branch", False),
                 (layer.norm1, "norm1", False), (layer.norm2, "norm2", False)]
        if layer.norm_first:
            sites += [(layer.norm2, "after_attn", True), (layer, "after_ffn", False)]
        else:
            sites += [(layer.norm1, "after_attn", True), (layer.norm2, "after_ffn", True)]
        hooks += [mod.register_forward_hook(keep(store, name, inp)) for mod, name, inp in sites]

    was_training = module.training
    flags = {p: p.requires_grad for p in module.parameters()}
    kw: dict[str, Any] = {"is_causal": is_causal}
    length = x.shape[1] if batch_first else x.shape[0]
    if is_causal and src_mask is None:
        src_mask = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=param_dtype)
    if src_mask is not None:
        src_mask = torch.as_tensor(src_mask)
        src_mask = src_mask if src_mask.dtype == torch.bool else src_mask.to(param_dtype)
        kw["mask" if isinstance(module, torch.nn.TransformerEncoder) else "src_mask"] = src_mask
    if valid is not None:
        kpm = torch.from_numpy(masks.to_torch_key_padding_mask(valid).copy())  # True = ignore
        if src_mask is not None and src_mask.dtype != torch.bool:  # PyTorch wants both masks of one kind
            kpm = torch.zeros(kpm.shape, dtype=param_dtype).masked_fill(kpm, -math.inf)
        kw["src_key_padding_mask"] = kpm
    try:
        module.eval()
        names, params = zip(*module.named_parameters(), strict=True)
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            xt = torch.tensor(x, dtype=param_dtype, requires_grad=True)
            out = module(xt, **kw)
            out_nld = out if batch_first else out.transpose(0, 1)
            loss = (out_nld.float() * torch.from_numpy(loss_w)).sum()
            grads = torch.autograd.grad(loss, [xt, *params])
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
        for p, flag in flags.items():
            p.requires_grad_(flag)
    t_grads = {"input": _f32(grads[0])} | {n: _f32(g) for n, g in zip(names, grads[1:], strict=True)}
    return _f32(out), [{k: _f32(v) for k, v in m.items()} for m in mids], t_grads


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(
    model: nn.Module, params: Any, x: jax.Array, valid: jax.Array, attn_mask: Any, loss_w: jax.Array
) -> Any:
    """Output, recorded intermediates and (param, input) gradients; compiled once per model and shapes."""

    def loss(p: Any, xs: jax.Array) -> tuple[jax.Array, Any]:
        y, state = model.apply({"params": p}, xs, valid, attn_mask=attn_mask, mutable=["intermediates"])
        return jnp.sum(y.astype(jnp.float32) * loss_w), (y, state["intermediates"])

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)


def _run_ours(
    cfg: BlockConfig | StackConfig, variables: Any, x: np.ndarray, valid: np.ndarray, attn_mask: Any,
    loss_w: np.ndarray,
) -> tuple[np.ndarray, Any, tuple[Any, np.ndarray]]:
    model = EncoderBlock(cfg) if isinstance(cfg, BlockConfig) else EncoderStack(cfg)
    am = None if attn_mask is None else jnp.asarray(attn_mask)
    (_, (y, mids)), (g_params, g_x) = _loss_and_grads(
        model, variables["params"], jnp.asarray(x), jnp.asarray(valid), am, jnp.asarray(loss_w)
    )

    def to_np(tree: Any) -> Any:
        return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)

    return np.asarray(y, np.float32), to_np(mids), (to_np(g_params), np.asarray(g_x, np.float32))
