"""compare: per-layer parity of our converted Encoder/Classifier against the transformers model."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.interop.hf.convert import from_hf, state_dict
from jaxblock.interop.torch import Check, ParityReport
from jaxblock.interop.torch.parity import eval_with_grads
from jaxblock.model import Classifier, Encoder

# (forward max abs diff at real positions, relative L2 gradient error) by our compute dtype, against the
# transformers model in float32. float32 is the bound (measured: <= 1e-6 forward, <= 8e-7 gradient).
# bfloat16: measured worst over the ten families, base and classifier (python -m jaxblock.interop.hf.measure:
# D=64, 2 layers; docs/families.md) 2.5e-2 forward / 1.5e-2 gradient; the bounds leave 2.4x and 2.6x headroom.
GRAD_FLOOR = 1e-3
TOLERANCES = {"float32": (2e-5, 1e-4), "bfloat16": (6e-2, 4e-2)}


def _layers(model: Any) -> list[Any]:
    base = getattr(model, model.base_model_prefix, model)
    for path in ("encoder.layer", "transformer.layer", "layers"):
        obj: Any = base
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is not None:
            return list(obj)
    raise TypeError(f"{type(model).__name__} has no layer list jaxblock knows")


def _run_hf(model: Any, tokens: np.ndarray, valid: np.ndarray, types: np.ndarray | None,
            loss_w: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], dict[str, np.ndarray]]:
    import torch

    kw: dict[str, Any] = {"input_ids": torch.from_numpy(tokens).long(),
                          "attention_mask": torch.from_numpy(valid.astype(np.int64))}
    if types is not None:
        kw["token_type_ids"] = torch.from_numpy(types).long()
    outs: list[Any] = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for layer in _layers(model)]
    with eval_with_grads(model, hooks) as (names, params):
        out = model(**kw)
        y = out.logits if hasattr(out, "logits") else out.last_hidden_state
        loss = (y.float() * torch.from_numpy(loss_w)).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    g = {n: gr.detach().float().numpy() for n, gr in zip(names, grads, strict=True) if gr is not None}
    return y.detach().float().numpy(), [o.detach().float().numpy() for o in outs], g


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(model: nn.Module, params: Any, tokens: jax.Array, valid: jax.Array, types: Any,
                    loss_w: jax.Array) -> Any:
    def loss(p: Any) -> tuple[jax.Array, Any]:
        y, state = model.apply({"params": p}, tokens, valid, token_type_ids=types, mutable=["intermediates"])
        return jnp.sum(y.astype(jnp.float32) * loss_w), (y, state["intermediates"])

    return jax.value_and_grad(loss, has_aux=True)(params)


def compare(
    model: Any, tokens: Any, valid_tokens: Any = None, *, token_type_ids: Any = None, dtype: str = "float32",
    seed: int = 0, forward_tol: float | None = None, grad_tol: float | None = None,
) -> ParityReport:
    """Convert a transformers model (base or *ForSequenceClassification) with from_hf and run both.

    tokens int[N, L]; valid_tokens bool[N, L], True = real, real tokens first (default: all real); it is
    transformers' attention_mask. Reports max |diff| of each layer's output and of the model output
    (last hidden state, or logits) at real positions, then the relative L2 error of every parameter's
    gradient of loss = sum(output * fixed random weights from `seed`, real positions only), both mapped
    to transformers' names. dtype: our compute dtype (transformers runs as loaded).
    """
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype={dtype!r}: compare measures {' or '.join(TOLERANCES)} (tolerances are measured)")
    cfg, variables = from_hf(model, dtype=dtype)
    tokens = np.asarray(tokens, np.int32)
    valid = np.ones(tokens.shape, bool) if valid_tokens is None else np.asarray(valid_tokens, bool)
    has_types = token_type_ids is not None and cfg.embedding.type_vocab_size
    types = np.asarray(token_type_ids, np.int32) if has_types else None
    classifier = "encoder" in variables["params"]
    ftol, gtol = TOLERANCES[dtype]
    ftol, gtol = forward_tol or ftol, grad_tol or gtol
    out_shape = (tokens.shape[0], cfg.num_classes) if classifier else (*tokens.shape, cfg.block.model_dim)
    loss_w = np.random.default_rng(seed).standard_normal(out_shape).astype(np.float32)
    if not classifier:
        loss_w *= valid[..., None]
    t_out, t_layers, t_grads = _run_hf(model, tokens, valid, types, loss_w)
    ours = Classifier(cfg) if classifier else Encoder(cfg)
    (_, (y, mids)), grads = _loss_and_grads(
        ours, variables["params"], jnp.asarray(tokens), jnp.asarray(valid),
        None if types is None else jnp.asarray(types), jnp.asarray(loss_w))
    stack = (mids["encoder"] if classifier else mids)["stack"]
    site = "after_ffn" if cfg.block.norm == "pre" else "norm2"
    checks = []
    for i, theirs in enumerate(t_layers):
        diff = np.abs(np.asarray(stack[f"layers_{i}"][site][0], np.float32) - theirs)[valid]
        checks.append(Check(f"layers_{i}", "forward", float(diff.max(initial=0.0)), ftol))
    y_np = np.asarray(y, np.float32)
    diff = np.abs(y_np - t_out) if classifier else np.abs(y_np - t_out)[valid]
    checks.append(Check("output", "forward", float(diff.max(initial=0.0)), ftol))
    ours_grads = state_dict(cfg, {"params": grads}, family=model.config.model_type)
    refs = {name: t_grads.get(name, np.zeros_like(g)) for name, g in ours_grads.items()}
    # A gradient that is 0 in exact arithmetic (the key bias: softmax ignores a constant added to all of a
    # query's scores) is rounding noise on both sides, so relative errors are taken against at least
    # GRAD_FLOOR times the largest parameter gradient norm.
    floor = GRAD_FLOOR * max(float(np.linalg.norm(r)) for r in refs.values())
    for name, g in ours_grads.items():
        denom = max(float(np.linalg.norm(refs[name])), floor) or 1.0
        checks.append(Check(f"grad {name}", "grad", float(np.linalg.norm(g - refs[name])) / denom, gtol))
    title = (f"transformers parity: {type(model).__name__} x{cfg.num_layers}, ours {dtype}; "
             f"{int(valid.sum())} real positions")
    return ParityReport(title, tuple(checks))

