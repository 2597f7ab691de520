"""The parity harness: run a PyTorch encoder layer or stack and ours on the same weights, compare.

Shapes: N batch, L length, D width. Our modules take x [N, L, D]; a PyTorch module built with
batch_first=False takes [L, N, D]. Mask convention (ours): `valid_tokens: bool[N, L]`, True = real.

Hook points come from the placement's wiring (jaxblock.wiring): a norm site is the output of the
PyTorch norm holding its weights, a branch the output of that branch's dropout, a residual add the
input of the norm that reads it, or the layer's output. A single layer runs on our side as a stack
of one; only the names in the report drop the `layers_0/` prefix.

Padded positions: PyTorch's TransformerEncoder fast path (eval, no autograd, norm_first=False,
batch_first, enable_nested_tensor=True, a key_padding_mask) runs on nested tensors and returns 0 at
padded positions, a fully padded row included (its final norm, if any, then maps those zeros to the
norm's bias); its slow path computes padded positions exactly as ours do. The layer's own fused fast
path (one TransformerEncoderLayer, eval, no autograd) returns NaN for a fully padded row; ours is
finite there. Parity is therefore measured at real positions only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from pydantic import ValidationError

from jaxblock import masks
from jaxblock.config import BlockConfig, StackConfig, format_validation_error
from jaxblock.interop.torch.mapping import as_stack, f32, from_torch, params_of, params_to_state_dict
from jaxblock.model import EncoderStack
from jaxblock.wiring import WIRINGS

# (forward max abs diff at real positions, relative L2 gradient error) by our compute dtype.
# Half precision against PyTorch in float32, one block, D <= 64, x ~ N(0, 1): measured worst cases are
# bfloat16 2.4e-2 forward / 8e-3 gradient, float16 3e-3 / 1e-3; the bounds leave 2-3x headroom.
# With ReLU, a bfloat16 hidden unit rounded across 0 flips its gradient: expect up to ~1e-1 there.
TOLERANCES = {"float32": (1e-5, 1e-4), "bfloat16": (6e-2, 2e-2), "float16": (6e-3, 3e-3)}

# Our block's submodule -> the TransformerEncoderLayer submodule whose output is that site's value.
_TORCH_SITE = {"attn_norm": "norm1", "ffn_norm": "norm2", "self_attn": "dropout1", "ffn": "dropout2"}
_ONE = "layers.0."


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
    single = isinstance(cfg, BlockConfig)
    params = params_of(variables if variables is not None else converted)
    variables = {"params": {"layers_0": params} if single else params}
    block = as_stack(cfg).block
    try:  # validated copy: a misspelt kernel or dtype fails here, naming the field
        block = BlockConfig.model_validate(
            block.model_dump() | {
                "dtype": dtype or block.dtype,
                "attention": block.attention.model_dump() | {"kernel": attention, "causal": is_causal},
            }
        )
    except ValidationError as err:
        raise ValueError(format_validation_error(err)) from None
    ours_cfg = as_stack(cfg).model_copy(update={"block": block})
    layers = _torch_layers(module)
    batch_first = bool(layers[0].self_attn.batch_first)
    ftol, gtol = TOLERANCES[block.dtype if block.dtype != "float32" else block.param_dtype]  # the lower precision
    ftol = ftol if forward_tol is None else forward_tol
    gtol = gtol if grad_tol is None else grad_tol

    x_np = f32(x)
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
        prefix = "" if single else f"layers_{i}/"
        for site in WIRINGS["pre" if layer.norm_first else "post"].order:
            checks.append(fwd(prefix + site, np.asarray(o_mid[f"layers_{i}"][site][0]), t_mid[i][site]))
    checks.append(fwd("output", o_out, t_out))
    checks.append(rel("grad input", o_grads[1], to_nld(t_grads.pop("input"))))
    checks += [rel(f"grad {name}", o_sd[(_ONE if single else "") + name], g) for name, g in t_grads.items()]
    kind = type(module).__name__ + ("" if single else f" x{ours_cfg.num_layers}")
    title = (f"PyTorch parity: {kind}, {block.norm}-LN, ours {block.dtype} attention='{attention}', "
             f"PyTorch {block.param_dtype} slow path; {int(valid.sum())} real positions")
    return ParityReport(title, tuple(checks))


def _torch_layers(module: torch.nn.Module) -> list[torch.nn.TransformerEncoderLayer]:
    if isinstance(module, torch.nn.TransformerEncoder):
        return [layer for layer in module.layers if isinstance(layer, torch.nn.TransformerEncoderLayer)]
    if isinstance(module, torch.nn.TransformerEncoderLayer):
        return [module]
    raise TypeError(f"compare takes nn.TransformerEncoderLayer or nn.TransformerEncoder, got {type(module).__name__}")


@contextlib.contextmanager
def eval_with_grads(module: torch.nn.Module, hooks: list[Any]) -> Iterator[tuple[tuple[str, ...], tuple[Any, ...]]]:
    """`module` in eval mode under autograd with every parameter requiring grad, yielding (names, params);
    afterwards the hooks are removed and its training mode and requires_grad flags are as they were."""
    was_training = module.training
    flags = {p: p.requires_grad for p in module.parameters()}
    try:
        module.eval()
        names, params = zip(*module.named_parameters(), strict=True)
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            yield names, params
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
        for p, flag in flags.items():
            p.requires_grad_(flag)


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
        wiring = WIRINGS["pre" if layer.norm_first else "post"]
        for site in wiring.sites:
            if site.module is not None:  # a norm or a branch: that PyTorch submodule's output
                mod, use_input = getattr(layer, _TORCH_SITE[site.module]), False
            elif site.name == wiring.output:  # the residual add the layer returns
                mod, use_input = layer, False
            else:  # a residual add: the input of the norm that reads it
                reader = wiring.consumer(site.name, "norm")
                assert reader is not None and reader.module is not None
                mod, use_input = getattr(layer, _TORCH_SITE[reader.module]), True
            hooks.append(mod.register_forward_hook(keep(store, site.name, use_input)))

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
    with eval_with_grads(module, hooks) as (names, params):
        xt = torch.tensor(x, dtype=param_dtype, requires_grad=True)
        out = module(xt, **kw)
        out_nld = out if batch_first else out.transpose(0, 1)
        loss = (out_nld.float() * torch.from_numpy(loss_w)).sum()
        grads = torch.autograd.grad(loss, [xt, *params])
    t_grads = {"input": f32(grads[0])} | {n: f32(g) for n, g in zip(names, grads[1:], strict=True)}
    return f32(out), [{k: f32(v) for k, v in m.items()} for m in mids], t_grads


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
    cfg: StackConfig, variables: Any, x: np.ndarray, valid: np.ndarray, attn_mask: Any, loss_w: np.ndarray,
) -> tuple[np.ndarray, Any, tuple[Any, np.ndarray]]:
    model = EncoderStack(cfg)
    am = None if attn_mask is None else jnp.asarray(attn_mask)
    (_, (y, mids)), (g_params, g_x) = _loss_and_grads(
        model, variables["params"], jnp.asarray(x), jnp.asarray(valid), am, jnp.asarray(loss_w)
    )

    def to_np(tree: Any) -> Any:
        return jax.tree.map(lambda a: np.asarray(a, np.float32), tree)

    return np.asarray(y, np.float32), to_np(mids), (to_np(g_params), np.asarray(g_x, np.float32))
