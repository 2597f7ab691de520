"""Configs and weights between jaxblock and torch.nn.TransformerEncoderLayer / nn.TransformerEncoder.

Shapes: N batch, L length, D width, H heads, K = D / H head width, F FFN width, B blocks. Our modules
always take x [N, L, D]; a PyTorch module built with batch_first=False takes [L, N, D].

Parameter mapping (PyTorch name -> ours; PyTorch's nn.Linear computes x @ weight.T + bias):

    self_attn.in_proj_weight [3D, D], rows q | k | v   -> self_attn/{query,key,value}/kernel [D, H, K]
    self_attn.in_proj_bias [3D]                         -> self_attn/{query,key,value}/bias [H, K]
    self_attn.out_proj.weight [D, D], .bias [D]         -> self_attn/out/kernel [H, K, D], bias [D]
    linear1.weight [F, D], linear2.weight [D, F]        -> ffn/linear1/kernel [D, F], ffn/linear2/kernel [F, D]
    norm1.weight, norm1.bias / norm2.*                  -> attn_norm/{scale,bias} / ffn_norm/{scale,bias}
    (TransformerEncoder) layers.i.* / norm.*            -> layers_i/* / final_norm/*

A single layer is mapped as a stack of one without a final norm: `layers.0.*` <-> `layers_0/*`,
with the prefix dropped at the boundary.

Causal attention is a call-time argument in PyTorch (`is_causal=True` plus a causal `src_mask`),
not a module attribute, so `from_torch` returns attention.causal=False and `to_torch` refuses it True;
`torch_call_kwargs` builds the masks that reproduce our call on the PyTorch module.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.nn import functional

from jaxblock import masks
from jaxblock.config import AttentionConfig, BlockConfig, StackConfig
from jaxblock.model import unstack_layer_params

TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES_TORCH = {v: k for k, v in TORCH_DTYPES.items()}


def as_stack(config: BlockConfig | StackConfig) -> StackConfig:
    """A BlockConfig as a stack of one block without a final norm; a StackConfig as it is."""
    if isinstance(config, StackConfig):
        return config
    return StackConfig(num_layers=1, final_norm=False, block=config)

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
    dtype = TORCH_DTYPES.get(attn.in_proj_weight.dtype)
    if dtype is None:
        raise ValueError(f"parameters are {attn.in_proj_weight.dtype}: convert with module.float() first")
    return BlockConfig(
        model_dim=attn.embed_dim, num_heads=attn.num_heads, ffn_dim=layer.linear1.out_features,
        attention=AttentionConfig(dropout=attn.dropout), ffn_dropout=attn.dropout, residual_dropout=attn.dropout,
        norm="pre" if layer.norm_first else "post", norm_eps=layer.norm1.eps,
        activation=_activation_name(layer.activation), use_bias=use_bias,
        dtype=dtype, param_dtype=dtype, init="torch",
    )


def _check_expressible(cfg: BlockConfig) -> None:
    """One-line ValueError naming the first field nn.TransformerEncoderLayer cannot express."""
    att = cfg.attention
    rates = {att.dropout, cfg.ffn_dropout, cfg.residual_dropout}
    problems = [
        (cfg.kv_heads != cfg.num_heads, f"num_kv_heads={cfg.num_kv_heads} (GQA/MQA)", "leave num_kv_heads unset"),
        (att.rope, "attention.rope=True", "use learned or sinusoidal positions"),
        (cfg.norm_type != "layernorm", f"norm_type='{cfg.norm_type}'", "use norm_type='layernorm'"),
        (cfg.is_glu, f"activation='{cfg.activation}' (gated FFN)", "use 'relu' or 'gelu'"),
        (cfg.activation == "gelu_tanh", "activation='gelu_tanh'", "use exact 'gelu'"),
        (len(rates) > 1, f"differing dropout rates {sorted(rates)}", "set attn/ffn/residual dropout equal"),
        (cfg.ablate != "none", f"ablate='{cfg.ablate}'", "use ablate='none'"),
        (cfg.dtype != cfg.param_dtype, f"dtype='{cfg.dtype}' with param_dtype='{cfg.param_dtype}'",
         "set dtype equal to param_dtype (use torch.autocast for mixed precision)"),
        (att.causal, "attention.causal=True (PyTorch takes is_causal at call time)",
         "convert with causal=False and call with torch_call_kwargs(..., causal=True)"),
        (cfg.has_qkv_bias != cfg.use_bias, f"attention.qkv_bias={att.qkv_bias} with use_bias={cfg.use_bias}",
         "PyTorch's bias= covers every sublayer: leave attention.qkv_bias unset"),
        (cfg.has_out_bias != cfg.use_bias, f"attention.out_bias={att.out_bias} with use_bias={cfg.use_bias}",
         "PyTorch's bias= covers every sublayer: leave attention.out_bias unset"),
    ]
    for bad, what, fix in problems:
        if bad:
            raise ValueError(f"{what} has no nn.TransformerEncoderLayer equivalent: {fix}")


# --- parameter mapping --------------------------------------------------------------------------


def f32(a: Any) -> np.ndarray:
    """A tensor or array as float32 NumPy (detached, on the CPU)."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().float().numpy()
    return np.asarray(a, np.float32)


def _block_state_dict(cfg: BlockConfig, p: Any, prefix: str = "") -> dict[str, np.ndarray]:
    d = cfg.model_dim
    a = p["self_attn"]
    sd = {
        "self_attn.in_proj_weight": np.concatenate(
            [f32(a[n]["kernel"]).reshape(d, d).T for n in ("query", "key", "value")]
        ),  # [3D, D]
        "self_attn.out_proj.weight": f32(a["out"]["kernel"]).reshape(d, d).T,  # [H, K, D] -> [D, H*K]
        "linear1.weight": f32(p["ffn"]["linear1"]["kernel"]).T,  # [F, D]
        "linear2.weight": f32(p["ffn"]["linear2"]["kernel"]).T,  # [D, F]
        "norm1.weight": f32(p["attn_norm"]["scale"]),
        "norm2.weight": f32(p["ffn_norm"]["scale"]),
    }
    if cfg.use_bias:
        sd["self_attn.in_proj_bias"] = np.concatenate(
            [f32(a[n]["bias"]).reshape(d) for n in ("query", "key", "value")]
        )
        sd["self_attn.out_proj.bias"] = f32(a["out"]["bias"])
        sd["linear1.bias"] = f32(p["ffn"]["linear1"]["bias"])
        sd["linear2.bias"] = f32(p["ffn"]["linear2"]["bias"])
        sd["norm1.bias"] = f32(p["attn_norm"]["bias"])
        sd["norm2.bias"] = f32(p["ffn_norm"]["bias"])
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


def params_of(variables: Any) -> Any:
    """Plain per-layer params from {'params': ...} or a bare tree; boxed, stacked or nested trees accepted."""
    p = nn.unbox(variables)
    p = p.get("params", p)
    for outer in ("encoder", "stack"):  # a Classifier's or Encoder's tree holds the stack inside
        p = p.get(outer, p)
    return unstack_layer_params(p)


_ONE = "layers.0."  # a single layer's names inside its stack of one


def params_to_state_dict(config: BlockConfig | StackConfig, variables: Any) -> dict[str, np.ndarray]:
    """Our params (or gradients, the map is linear) -> PyTorch state-dict names, float32 numpy."""
    stack, p = as_stack(config), params_of(variables)
    if isinstance(config, BlockConfig):
        p = {"layers_0": p}
    try:
        sd: dict[str, np.ndarray] = {}
        for i in range(stack.num_layers):
            sd |= _block_state_dict(stack.block, p[f"layers_{i}"], f"layers.{i}.")
        if stack.has_final_norm:
            sd["norm.weight"] = f32(p["final_norm"]["scale"])
            if stack.block.use_bias:
                sd["norm.bias"] = f32(p["final_norm"]["bias"])
    except KeyError as err:
        raise ValueError(
            f"variables lack {err} that the config requires: pass the variables built for this config"
        ) from None
    return {k.removeprefix(_ONE): v for k, v in sd.items()} if isinstance(config, BlockConfig) else sd


def state_dict_to_params(config: BlockConfig | StackConfig, state_dict: dict[str, Any]) -> dict[str, Any]:
    """PyTorch state dict (tensors or arrays) -> our plain params tree, in config.param_dtype."""
    stack = as_stack(config)
    prefix = _ONE if isinstance(config, BlockConfig) else ""
    sd = {prefix + k: f32(v) for k, v in state_dict.items()}
    p = {f"layers_{i}": _block_params(stack.block, sd, f"layers.{i}.") for i in range(stack.num_layers)}
    if stack.has_final_norm:
        dt = stack.block.params_dtype
        p["final_norm"] = {"scale": jnp.asarray(sd["norm.weight"], dt)}
        if stack.block.use_bias:
            p["final_norm"]["bias"] = jnp.asarray(sd["norm.bias"], dt)
    return p["layers_0"] if isinstance(config, BlockConfig) else p


# --- conversion ---------------------------------------------------------------------------------


def from_torch(module: torch.nn.Module) -> tuple[BlockConfig | StackConfig, dict[str, Any]]:
    """nn.TransformerEncoderLayer -> (BlockConfig, variables) for EncoderBlock;
    nn.TransformerEncoder -> (StackConfig, variables) for EncoderStack.

    Fields PyTorch has no notion of keep their defaults (attention kernel, fused_qkv), init is 'torch'
    and attention.causal is False (PyTorch decides it per call). batch_first only changes the layout PyTorch
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
    if isinstance(config, StackConfig) and config.layers.per_layer:
        name = next(iter(config.layers.per_layer))
        raise ValueError(f"layers.{name}={getattr(config.layers, name)} has no nn.TransformerEncoder equivalent (its "
                         "layers are identical copies): remove the per-layer settings")
    layer = torch.nn.TransformerEncoderLayer(
        block.model_dim, block.num_heads, block.ffn_dim, dropout=block.attention.dropout, activation=block.activation,
        layer_norm_eps=block.norm_eps, batch_first=batch_first, norm_first=block.norm == "pre",
        bias=block.use_bias, dtype=DTYPES_TORCH[block.param_dtype],
    )
    module: torch.nn.Module = layer
    if isinstance(config, StackConfig):
        norm = None
        if config.has_final_norm:
            norm = torch.nn.LayerNorm(
                block.model_dim, eps=block.norm_eps, bias=block.use_bias, dtype=DTYPES_TORCH[block.param_dtype]
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
