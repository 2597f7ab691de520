"""Pass/fail checks: padding invariance, sublayer ablation, structure, train/eval determinism.

Ablation and structure replay the placement's wiring (jaxblock.wiring) with float64 reference norms
and compare with what each block computed, so a block wired differently from its placement's
description fails them even when every submodule keeps its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.diagnostics.reference import f64, fmt_list, norm, real, rel_err, unnormalized_error
from jaxblock.diagnostics.report import CheckResult
from jaxblock.diagnostics.tracing import (
    Path,
    Trace,
    block_config,
    block_paths,
    prepare,
    skipped_norms,
    subtree,
    trace,
    wiring,
    with_block_params,
    zero_branch,
)
from jaxblock.wiring import BLOCK_INPUT, BRANCHES, Wiring

Batch = Mapping[str, Any]
Part = tuple[str, bool, str]


def _with_padding(batch: Batch) -> dict[str, Any]:
    """A batch that has padding: if none, the second half of every other row becomes padding."""
    valid = np.asarray(batch["valid_tokens"], bool)
    if (~valid).any() or valid.shape[1] < 2:
        return dict(batch)
    valid = valid.copy()
    valid[1::2, valid.shape[1] // 2 :] = False
    return {**batch, "valid_tokens": jnp.asarray(valid)}


def padding_invariance(model: nn.Module, variables: Any, batch: Batch, *, seed: int = 0,
                       tol: float = 1e-5) -> CheckResult:
    """Change only padded inputs: every block's real positions and the output must not move."""
    model, v = prepare(model, variables)
    a = _with_padding(batch)
    pad = ~np.asarray(a["valid_tokens"], bool)
    rng = np.random.default_rng(seed)
    b = dict(a)
    if "x" in a:
        x = np.asarray(a["x"])
        noise = rng.normal(3.0, 5.0, x.shape).astype(x.dtype)
        b["x"] = jnp.asarray(np.where(pad[..., None], noise, x))
    else:
        tok = np.asarray(a["tokens"])
        vocab = int(getattr(model.config, "vocab_size", tok.max() + 2))
        shifted = (tok + rng.integers(1, max(vocab, 2), tok.shape)) % vocab  # always a different token
        b["tokens"] = jnp.asarray(np.where(pad, shifted, tok).astype(tok.dtype))
    ta, tb = trace(model, v, a), trace(model, v, b)
    valid = ~pad
    parts = []
    for i, (ya, yb) in enumerate(zip(ta.outputs, tb.outputs, strict=True)):
        err = rel_err(real(yb, valid), real(ya, valid))
        parts.append((f"layer {i} real positions", err <= tol, f"max change {err:.2g} (tol {tol:g})"))
    oa, ob = (ta.output, tb.output) if ta.output.ndim == 2 else (real(ta.output, valid), real(tb.output, valid))
    err = rel_err(ob, oa)
    what = "pooled logits" if ta.output.ndim == 2 else "output real positions"
    parts.append((what, err <= tol, f"max change {err:.2g} (tol {tol:g}) with {int(pad.sum())} padded tokens changed"))
    return CheckResult.of("padding_invariance", parts)


def _replayed(w: Wiring, t: Trace, params: list[Any], cfg: Any, valid: Any, i: int,
              zeroed: tuple[str, ...] = (), skip: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Block i's values recomputed from its input and recorded branches (zeros for `zeroed` sites;
    norms in `skip` are bypassed by a per-layer setting: identity)."""
    x = real(t.inputs[i], valid)
    branches = {b.site: np.zeros_like(x) if b.site in zeroed else real(t.records[i][b.site], valid)
                for b in BRANCHES}

    def norm_of(value: np.ndarray, module: str) -> np.ndarray:
        if module in skip:
            return value
        if module not in params[i]:  # a missing instance (structure reports it) poisons what reads it
            return np.full_like(value, np.nan)
        return norm(value, params[i][module], cfg)

    return w.replay(x, branches, norm_of)


def sublayer_ablation(model: nn.Module, variables: Any, batch: Batch, *, tol: float = 1e-4) -> CheckResult:
    """Zero one branch's last projection: each block must equal its wiring with that branch zero
    (Pre-LN: y = x + branch(LN(x)); Post-LN: y = LN2(LN1(x) + FFN) or LN2(LN1(x + MHA)))."""
    model, v = prepare(model, variables)
    cfg, w = block_config(model), wiring(model)
    valid = batch["valid_tokens"]
    paths = block_paths(model, v, batch)
    layers = [subtree(v["params"], p) for p in paths]
    skips = skipped_norms(model, len(paths))
    parts = []
    for branch in BRANCHES:
        other = next(b for b in BRANCHES if b is not branch)
        if not all(branch.module in layer for layer in layers):
            parts.append((f"zero {branch.name}", True, "the blocks have no such branch (ablated by config)"))
            continue
        t = trace(model, zero_branch(v, paths, branch.name), batch)
        errs = [rel_err(real(t.outputs[i], valid), _replayed(w, t, layers, cfg, valid, i, (branch.site,),
                                                                   skips[i])[w.output])
                for i in range(len(t.outputs))]
        worst = max(errs, default=0.0)
        parts.append((f"zero {branch.name}: block = identity + {other.site}", worst <= tol,
                      f"max error {worst:.2g} (tol {tol:g}) per layer: {fmt_list(errs)}"))
    return CheckResult.of("sublayer_ablation", parts)


def _randomize_norms(v: dict[str, Any], paths: list[Path], w: Wiring, seed: int) -> dict[str, Any]:
    """Distinct random affine params per norm instance: a shared or misplaced norm then shows in the values."""
    keys = iter(jax.random.split(jax.random.key(seed), 2 * len(w.norms) * len(paths)))

    def randomize(_: int, layer: dict[str, Any]) -> dict[str, Any]:
        for site in w.norms:
            assert site.module is not None
            p = dict(layer[site.module])
            p["scale"] = jax.random.uniform(next(keys), p["scale"].shape, p["scale"].dtype, 0.5, 1.5)
            if "bias" in p:
                p["bias"] = jax.random.normal(next(keys), p["bias"].shape, p["bias"].dtype) * 0.5
            layer[site.module] = p
        return layer

    return with_block_params(v, paths, randomize)


def structure(model: nn.Module, variables: Any, batch: Batch, *, seed: int = 0, tol: float = 1e-4,
              norm_tol: float = 2e-2) -> CheckResult:
    """The block computes its placement's wiring: each norm site is its own norm instance applied to
    the value the wiring names, every recorded value equals the wiring replayed from the block input
    and branches; with both branches zeroed each block is its wiring with zero branches (the identity
    for Pre-LN); a block whose wiring ends in a norm has normalized outputs, otherwise the stack's
    final norm normalizes its output."""
    model, v = prepare(model, variables)
    cfg, w = block_config(model), wiring(model)
    valid = batch["valid_tokens"]
    paths = block_paths(model, v, batch)
    layers = [subtree(v["params"], p) for p in paths]
    skips = skipped_norms(model, len(paths))
    parts: list[Part] = []

    missing = [f"{'/'.join(p)}/{s.module}" for p, layer in zip(paths, layers, strict=True)
               for s in w.norms if s.module not in layer]
    if missing:
        parts.append((f"{len(w.norms)} norm instances per block", False,
                      f"{', '.join(missing)} missing: give each sublayer its own norm"))
    else:
        rv = _randomize_norms(v, paths, w, seed)
        rlayers = [subtree(rv["params"], p) for p in paths]
        t = trace(model, rv, batch)
        norm_errs, replay_errs = [], []
        for i, rec in enumerate(t.records):
            values = {**{k: real(r, valid) for k, r in rec.items()}, BLOCK_INPUT: real(t.inputs[i], valid)}
            norm_errs.append(max((rel_err(values[s.name], values[s.inputs[0]] if s.module in skips[i] else
                                          norm(values[s.inputs[0]], rlayers[i][s.module], cfg))
                                  for s in w.norms if s.module is not None and s.name in values), default=0.0))
            replay = _replayed(w, t, rlayers, cfg, valid, i, skip=skips[i])
            replay_errs.append(max([rel_err(values[s], replay[s]) for s in w.order if s in values]
                                   + [rel_err(real(t.outputs[i], valid), replay[w.output])]))
        described = ", ".join(f"{s.name} = {s.module}({s.inputs[0]})" for s in w.norms)
        worst = max(norm_errs, default=0.0)
        parts.append((described, worst <= tol,
                      f"max error {worst:.2g} (tol {tol:g}) per layer: {fmt_list(norm_errs)}"))
        worst = max(replay_errs, default=0.0)
        what = f"every recorded value and the output follow the {w.placement.capitalize()}-LN wiring"
        parts.append((what, worst <= tol, f"max error {worst:.2g} (tol {tol:g}) per layer: {fmt_list(replay_errs)}"))
        if all(b.module in layer for layer in layers for b in BRANCHES):
            both = tuple(b.site for b in BRANCHES)
            t = trace(model, zero_branch(zero_branch(v, paths, "attention"), paths, "ffn"), batch)
            errs = [rel_err(real(y, valid), _replayed(w, t, layers, cfg, valid, i, both, skips[i])[w.output])
                    for i, y in enumerate(t.outputs)]
            worst = max(errs, default=0.0)
            what = "its norms alone" if w.output_is_normalized else "the identity"
            parts.append((f"both branches zeroed: each {w.placement.capitalize()}-LN block is {what}", worst <= tol,
                          f"max error {worst:.2g} (tol {tol:g}) per layer: {fmt_list(errs)}"))

    t = trace(model, v, batch)
    if w.output_is_normalized:
        out_norm = w.site(w.output).module
        errs = [unnormalized_error(real(y, valid), layers[i].get(out_norm), cfg) for i, y in enumerate(t.outputs)]
        worst = max(errs, default=0.0)
        parts.append((f"each {w.placement.capitalize()}-LN block output normalized per token", worst <= norm_tol,
                      f"max |mean|, |rms - 1| {worst:.2g} (tol {norm_tol:g}) per layer: {fmt_list(errs)}"))
    else:
        what = f"{w.placement.capitalize()}-LN stack output normalized per token"
        stack = subtree(v["params"], t.stack_path) if t.stack_path is not None else {}
        if "final_norm" not in stack:
            parts.append((what, False, f"no final_norm: a {w.placement.capitalize()}-LN stack needs one "
                                       "(final_norm=True or None)"))
        elif t.stack_output is None:
            parts.append((what, False, "the stack output was not seen"))
        else:
            err = unnormalized_error(real(t.stack_output, valid), stack["final_norm"], cfg)
            parts.append((what, err <= norm_tol,
                          f"max |mean|, |rms - 1| after undoing final_norm's affine: {err:.2g} (tol {norm_tol:g})"))
    return CheckResult.of("structure", parts)


def train_eval_determinism(model: nn.Module, variables: Any, batch: Batch, *, seed: int = 0) -> CheckResult:
    """Eval repeats exactly; training repeats with the same dropout key and, when any dropout rate
    is positive, differs between keys and from eval (with none, training equals eval)."""
    model, v = prepare(model, variables)
    cfg, bcfg = model.config, block_config(model)
    embedding = getattr(cfg, "embedding", None)
    rates = [bcfg.attention.dropout, bcfg.ffn_dropout, bcfg.residual_dropout, embedding.dropout if embedding else 0.0]
    k1, k2 = jax.random.split(jax.random.key(seed))

    def run(train: bool, key: jax.Array | None = None) -> np.ndarray:
        return f64(trace(model, v, batch, train=train, rngs={"dropout": key} if train else None).output)

    e1, e2 = run(False), run(False)
    t1, t1b, t2 = run(True, k1), run(True, k1), run(True, k2)
    parts = [
        ("eval repeats exactly", bool(np.array_equal(e1, e2)), f"max difference {np.max(np.abs(e1 - e2)):.2g}"),
        ("train repeats with the same key", bool(np.array_equal(t1, t1b)),
         f"max difference {np.max(np.abs(t1 - t1b)):.2g}"),
    ]
    if max(rates) > 0:
        parts.append(("train differs between dropout keys", not np.allclose(t1, t2, atol=1e-6),
                      f"max difference {np.max(np.abs(t1 - t2)):.2g}"))
        parts.append(("train differs from eval", not np.allclose(t1, e1, atol=1e-6),
                      f"max difference {np.max(np.abs(t1 - e1)):.2g}"))
    else:
        err = rel_err(t1, e1)
        parts.append(("no dropout configured: train equals eval", err <= 1e-6, f"max difference {err:.2g}"))
    return CheckResult.of("train_eval_determinism", parts)
