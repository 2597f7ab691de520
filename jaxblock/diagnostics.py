"""The debugging path as functions: residual ratios, gradient norms by depth, the first non-finite
sublayer, padding invariance, sublayer ablation, structure, train/eval determinism.

Shapes: N batch, L length, D width, K blocks. Mask convention: `valid_tokens: bool[N, L]`, True = real.

Every function takes a model, its variables and a batch (DESIGN.md's keys), never a config, so a
variant model class can be examined as easily as the library's own:

- Classifier / Encoder: `batch["tokens"]` int32[N, L]; EncoderStack or any stack-like module:
  `batch["x"]` float[N, L, D]. Both with `batch["valid_tokens"]` bool[N, L].
- The model has a `config` (EncoderConfig / StackConfig); its blocks are submodules named
  `layers_0 .. layers_{K-1}` that record the DESIGN.md intermediates (`norm1, attn_branch,
  after_attn, norm2, ffn_branch, after_ffn`). Each block's input and output are taken at its call
  boundary (Flax method interception), so no check trusts what a block chooses to record about itself.
- A scanned or rematerialized stack is examined through its unrolled twin (same parameters,
  unstacked): the mathematics is identical and every layer's values become visible.
- `variables` may be boxed (LogicallyPartitioned) or plain; `{"params": ...}` or the params alone.
- A `loss_fn(outputs, batch)` returns a scalar or `(scalar, aux)`.

Each function returns a small dataclass with a readable `str`; checks have `passed`, measurements
`as_metrics() -> dict[str, float]`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxblock.block import RECORDED_SITES
from jaxblock.model import unstack_layer_params

Batch = Mapping[str, Any]
LossFn = Callable[[jax.Array, Batch], Any]

_LAYER = re.compile(r"layers_(\d+)")
_SITES = RECORDED_SITES["pre"]
# Last projection of each residual branch: zeroing it removes the branch (its bias included).
_BRANCH_OUT = {"attention": ("self_attn", "out"), "ffn": ("ffn", "linear2")}


# --- running a model with every block's boundary visible ------------------------------------------


@dataclass
class Trace:
    """One forward pass: the model output and, per block, its input, output and recorded values."""

    output: jax.Array
    stack_output: jax.Array | None  # [N, L, D] after the final norm (None if not seen)
    inputs: list[jax.Array]  # K x [N, L, D]
    outputs: list[jax.Array]  # K x [N, L, D]
    records: list[dict[str, jax.Array]]  # K x {site: [N, L, D]}


def prepare(model: nn.Module, variables: Any) -> tuple[nn.Module, dict[str, Any]]:
    """Plain, per-layer variables and the unrolled twin of a scanned/rematerialized model."""
    v = nn.unbox(variables)
    if "params" not in v:
        v = {"params": v}
    v = {k: val for k, val in v.items() if k not in ("intermediates", "perturbations")}
    cfg = getattr(model, "config", None)
    if cfg is not None and (getattr(cfg, "scan_layers", False) or getattr(cfg, "remat", "none") != "none"):
        model = model.clone(config=cfg.model_copy(update={"scan_layers": False, "remat": "none"}))
        v = unstack_layer_params(v)
    return model, v


def trace(
    model: nn.Module,
    variables: Mapping[str, Any],
    batch: Batch,
    *,
    train: bool = False,
    rngs: Any = None,
    deltas: Sequence[jax.Array] | None = None,
) -> Trace:
    """Run `model` (already `prepare`d) and capture every block boundary.

    deltas: K arrays [N, L, D] added to each block's input, so that the gradient with respect to
    them is the gradient at each layer's input. Runs eagerly on purpose: XLA's CPU compile of these
    small graphs costs more than running them op by op, and ops of equal shapes compile once.
    """
    inputs: dict[int, jax.Array] = {}
    outputs: dict[int, jax.Array] = {}
    stack_out: list[jax.Array] = []
    active: set[int] = set()

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, ctx: Any) -> Any:
        name = ctx.module.name or ""
        match = _LAYER.fullmatch(name)
        # A subclass's __call__ calling super().__call__ is intercepted twice: keep the outer call.
        if ctx.method_name != "__call__" or id(ctx.module) in active or not (match or name == "stack"):
            return next_fun(*args, **kwargs)
        active.add(id(ctx.module))
        try:
            if match:
                i = int(match.group(1))
                if deltas is not None:
                    args = (args[0] + deltas[i].astype(args[0].dtype), *args[1:])
                inputs[i] = args[0]
            out = next_fun(*args, **kwargs)
        finally:
            active.discard(id(ctx.module))
        if match:
            outputs[i] = out
        else:
            stack_out.append(out)
        return out

    x = batch["x"] if "x" in batch else batch["tokens"]
    extra = {"segment_ids": batch["segment_ids"]} if batch.get("segment_ids") is not None else {}
    with nn.intercept_methods(interceptor):
        out, state = model.apply(
            variables, x, batch["valid_tokens"], train=train, rngs=rngs, mutable=["intermediates"], **extra
        )
    records = _layer_dicts(state.get("intermediates", {}))
    num = len(inputs)
    if sorted(inputs) != list(range(num)):
        raise ValueError(f"blocks seen: {sorted(inputs)}; name the blocks layers_0..layers_{{K-1}}")
    recs = [{k: v[0] for k, v in records.get(i, {}).items() if k in _SITES} for i in range(num)]
    stack_output = stack_out[-1] if stack_out else (out if out.ndim == 3 else None)
    return Trace(out, stack_output, [inputs[i] for i in range(num)], [outputs[i] for i in range(num)], recs)


def _stack_params(tree: Any) -> Mapping[str, Any]:
    """The dict holding layers_0..layers_{K-1} (and final_norm), wherever it sits in the tree."""
    if not isinstance(tree, Mapping):
        return {}
    if any(_LAYER.fullmatch(str(k)) for k in tree):
        return tree
    for v in tree.values():
        found = _stack_params(v)
        if found:
            return found
    return {}


def _layer_dicts(tree: Any) -> dict[int, Any]:
    """layers_i subtrees by layer index i."""
    return {int(m.group(1)): v for k, v in _stack_params(tree).items() if (m := _LAYER.fullmatch(str(k)))}


def _with_layer_params(variables: dict[str, Any], fn: Callable[[int, dict[str, Any]], dict[str, Any]]) -> Any:
    """Copy of variables with fn(i, layer_params) replacing each layers_i params subtree."""

    def walk(tree: Any) -> Any:
        if not isinstance(tree, Mapping):
            return tree
        out = {}
        for k, v in tree.items():
            m = _LAYER.fullmatch(str(k))
            out[k] = fn(int(m.group(1)), dict(v)) if m else walk(v)
        return out

    return {**variables, "params": walk(variables["params"])}


def _zero_branch(variables: dict[str, Any], branch: str) -> Any:
    mod, proj = _BRANCH_OUT[branch]

    def zero(_: int, layer: dict[str, Any]) -> dict[str, Any]:
        if mod in layer and proj in layer[mod]:
            layer[mod] = {**layer[mod], proj: jax.tree.map(jnp.zeros_like, layer[mod][proj])}
        return layer

    return _with_layer_params(variables, zero)


def _block_config(model: nn.Module) -> Any:
    cfg = model.config
    return getattr(cfg, "block", cfg)


def _np(x: Any) -> np.ndarray:
    return np.asarray(x, np.float64)


def _real(x: Any, valid: Any) -> np.ndarray:
    """[N, L, D] -> [T, D]: the real tokens only."""
    return _np(x)[np.asarray(valid, bool)]


def _norm(x: np.ndarray, params: Mapping[str, Any], cfg: Any) -> np.ndarray:
    """The block's norm recomputed independently (float64) with the given instance's params."""
    if cfg.norm_type == "rmsnorm":
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps)
    else:
        c = x - np.mean(x, -1, keepdims=True)
        y = c / np.sqrt(np.mean(c * c, -1, keepdims=True) + cfg.norm_eps)
    y = y * _np(params["scale"])[None, :]
    return y + _np(params["bias"])[None, :] if "bias" in params else y


def _unnormalized_error(y: np.ndarray, params: Mapping[str, Any] | None, cfg: Any) -> float:
    """How far tokens [T, D] are from a norm's output: undo its affine, then |mean| and |rms - 1|."""
    if params is not None:
        scale = _np(params["scale"])
        keep = np.abs(scale) > 1e-3  # a feature scaled to ~0 carries no information about the statistics
        bias = _np(params["bias"]) if "bias" in params else np.zeros_like(scale)
        y = (y - bias[None, :]) / np.where(keep, scale, 1.0)[None, :]
        y = y[:, keep]
    rms = np.sqrt(np.mean(y * y, -1))
    err = np.abs(rms - 1.0)
    if cfg.norm_type != "rmsnorm":
        err = np.maximum(err, np.abs(np.mean(y, -1)))
    return float(np.max(err)) if err.size else 0.0


def _rel_err(a: Any, b: Any) -> float:
    a, b = _np(a), _np(b)
    return float(np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b))))


def _fmt_list(xs: Sequence[float]) -> str:
    return " ".join(f"{x:.3g}" for x in xs)


# --- measurements ---------------------------------------------------------------------------------


@dataclass
class ResidualRatios:
    """||branch|| / ||residual input|| per layer over real tokens: Pre-LN ||S(LN(x))||/||x||,
    Post-LN ||S(x)||/||x||. A jump to tens of times signals a learning rate, init or numerics problem."""

    placement: str
    attn: list[float]
    ffn: list[float]
    limit: float
    passed: bool
    name: str = "residual_ratios"

    def as_metrics(self) -> dict[str, float]:
        out = {f"residual_ratio/attn/layer_{i}": r for i, r in enumerate(self.attn)}
        return out | {f"residual_ratio/ffn/layer_{i}": r for i, r in enumerate(self.ffn)}

    def summary(self) -> str:
        worst = max(self.attn + self.ffn, default=0.0)
        verdict = "ok" if self.passed else "above the limit: lower the learning rate or check the init"
        return f"largest ratio {worst:.3g} (limit {self.limit:g}): {verdict}"

    def __str__(self) -> str:
        return f"residual ratios ({self.placement}-LN)\n  attn: {_fmt_list(self.attn)}\n  ffn:  {_fmt_list(self.ffn)}"


def residual_ratios(model: nn.Module, variables: Any, batch: Batch, *, limit: float = 10.0) -> ResidualRatios:
    model, v = prepare(model, variables)
    t = trace(model, v, batch)
    valid = batch["valid_tokens"]
    ratios: dict[str, list[float]] = {"attn": [], "ffn": []}
    for rec in t.records:
        for key, branch, total in (("attn", "attn_branch", "after_attn"), ("ffn", "ffn_branch", "after_ffn")):
            b = _real(rec[branch], valid)
            x = _real(rec[total], valid) - b  # the sublayer's residual input
            ratios[key].append(float(np.linalg.norm(b)) / max(float(np.linalg.norm(x)), 1e-30))
    every = ratios["attn"] + ratios["ffn"]
    passed = bool(np.all(np.isfinite(every)) and max(every, default=0.0) <= limit)
    return ResidualRatios(_block_config(model).norm, ratios["attn"], ratios["ffn"], limit, passed)


@dataclass
class GradNorms:
    """Gradient norms by depth: at each layer's input, of each layer's parameters, and of each
    layer's FFN output kernel (ffn/linear2/kernel)."""

    loss: float
    input_grad: list[float]
    param_grad: list[float]
    ffn_out_kernel_grad: list[float]
    passed: bool
    name: str = "grad_norms_by_depth"

    def as_metrics(self) -> dict[str, float]:
        out = {f"grad_norm/input/layer_{i}": g for i, g in enumerate(self.input_grad)}
        return out | {f"grad_norm/params/layer_{i}": g for i, g in enumerate(self.param_grad)}

    def summary(self) -> str:
        if not self.passed:
            return "a gradient is non-finite: run first_nonfinite on the batch"
        ratio = self.input_grad[0] / max(self.input_grad[-1], 1e-30) if self.input_grad else 1.0
        return f"loss {self.loss:.4g}; input-gradient norm first/last layer = {ratio:.3g}"

    def __str__(self) -> str:
        return (
            f"gradient norms by depth (loss {self.loss:.4g})\n  at layer input: {_fmt_list(self.input_grad)}\n"
            f"  layer params:   {_fmt_list(self.param_grad)}\n  ffn/linear2:    {_fmt_list(self.ffn_out_kernel_grad)}"
        )


def grad_norms_by_depth(model: nn.Module, variables: Any, batch: Batch, loss_fn: LossFn) -> GradNorms:
    """Eval-mode gradients of loss_fn(model(batch), batch)."""
    model, v = prepare(model, variables)
    num = len(_layer_dicts(v["params"]))
    x = batch["x"] if "x" in batch else batch["tokens"]
    shape = (*x.shape[:2], _block_config(model).model_dim)

    def loss_of(params: Any, deltas: list[jax.Array]) -> jax.Array:
        out = trace(model, {**v, "params": params}, batch, deltas=deltas).output
        loss = loss_fn(out, batch)
        return loss[0] if isinstance(loss, tuple) else loss

    deltas = [jnp.zeros(shape, jnp.float32) for _ in range(num)]
    loss, (g_params, g_inputs) = jax.value_and_grad(loss_of, argnums=(0, 1))(v["params"], deltas)
    layers = _layer_dicts(g_params)
    param_grad = [float(optax.tree.norm(layers[i])) for i in range(num)]
    ffn_out = [float(jnp.linalg.norm(layers[i]["ffn"]["linear2"]["kernel"])) if "ffn" in layers[i] else 0.0
               for i in range(num)]
    input_grad = [float(jnp.linalg.norm(g)) for g in g_inputs]
    passed = bool(np.all(np.isfinite([float(loss), *input_grad, *param_grad])))
    return GradNorms(float(loss), input_grad, param_grad, ffn_out, passed)


# --- checks ---------------------------------------------------------------------------------------


@dataclass
class Stats:
    min: float
    max: float
    mean: float
    absmax: float
    nonfinite: int

    @classmethod
    def of(cls, x: Any) -> Stats:
        a = _np(x)
        fin = a[np.isfinite(a)]
        if not fin.size:
            return cls(np.nan, np.nan, np.nan, np.nan, int(a.size))
        return cls(float(fin.min()), float(fin.max()), float(fin.mean()), float(np.abs(fin).max()),
                   int(a.size - fin.size))

    def __str__(self) -> str:
        return (f"min {self.min:.4g}, max {self.max:.4g}, mean {self.mean:.4g}, absmax {self.absmax:.4g}, "
                f"non-finite {self.nonfinite}")


# Execution order of the recorded sites: (site, sublayer kind, the site whose value is its input;
# "x" is the block input).
_ORDER = {
    "pre": [("norm1", "norm", "x"), ("attn_branch", "attention", "norm1"), ("after_attn", "residual add", "x"),
            ("norm2", "norm", "after_attn"), ("ffn_branch", "FFN", "norm2"),
            ("after_ffn", "residual add", "after_attn")],
    "post": [("attn_branch", "attention", "x"), ("after_attn", "residual add", "x"), ("norm1", "norm", "after_attn"),
             ("ffn_branch", "FFN", "norm1"), ("after_ffn", "residual add", "norm1"), ("norm2", "norm", "after_ffn")],
}


@dataclass
class NonFinite:
    """Where the forward pass first produced a non-finite value, and its input's statistics."""

    passed: bool
    layer: int | None = None
    sublayer: str | None = None  # attention | FFN | norm | residual add | embedding | output
    site: str | None = None
    count: int = 0
    input_stats: Stats | None = None
    name: str = "first_nonfinite"

    def summary(self) -> str:
        if self.passed:
            return "every recorded value is finite"
        where = f"layer {self.layer} " if self.layer is not None else ""
        return f"first non-finite value in {where}{self.sublayer} ({self.site}, {self.count} values)"

    def __str__(self) -> str:
        return self.summary() + (f"; its input: {self.input_stats}" if self.input_stats else "")


def first_nonfinite(model: nn.Module, variables: Any, batch: Batch) -> NonFinite:
    model, v = prepare(model, variables)
    t = trace(model, v, batch)

    def bad(x: Any) -> int:
        return int(np.sum(~np.isfinite(_np(x))))

    if t.inputs and bad(t.inputs[0]):
        return NonFinite(False, None, "embedding", "layers_0 input", bad(t.inputs[0]), Stats.of(t.inputs[0]))
    order = _ORDER[_block_config(model).norm]
    for i, rec in enumerate(t.records):
        values = {**rec, "x": t.inputs[i]}
        for site, kind, source in order:
            if site in rec and bad(rec[site]):
                return NonFinite(False, i, kind, site, bad(rec[site]), Stats.of(values[source]))
        if bad(t.outputs[i]):  # a variant that records nothing still gets its layer named
            return NonFinite(False, i, "block", "output", bad(t.outputs[i]), Stats.of(t.inputs[i]))
    if bad(t.output):
        last = t.stack_output if t.stack_output is not None else t.outputs[-1]
        return NonFinite(False, None, "output", "final norm / head", bad(t.output), Stats.of(last))
    return NonFinite(True)


@dataclass
class CheckResult:
    """A check made of named parts, each with its measured error and tolerance."""

    name: str
    passed: bool
    parts: list[tuple[str, bool, str]] = field(default_factory=list)

    def summary(self) -> str:
        failed = [f"{n}: {d}" for n, ok, d in self.parts if not ok]
        return "; ".join(failed) if failed else f"{len(self.parts)} parts pass"

    def __str__(self) -> str:
        lines = [f"{self.name}: {'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  [{'ok' if ok else 'FAIL'}] {n}: {d}" for n, ok, d in self.parts]
        return "\n".join(lines)


def _result(name: str, parts: list[tuple[str, bool, str]]) -> CheckResult:
    return CheckResult(name, all(ok for _, ok, _ in parts), parts)


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
    real = ~pad
    parts = []
    for i, (ya, yb) in enumerate(zip(ta.outputs, tb.outputs, strict=True)):
        err = _rel_err(_real(yb, real), _real(ya, real))
        parts.append((f"layer {i} real positions", err <= tol, f"max change {err:.2g} (tol {tol:g})"))
    oa, ob = (ta.output, tb.output) if ta.output.ndim == 2 else (_real(ta.output, real), _real(tb.output, real))
    err = _rel_err(ob, oa)
    what = "pooled logits" if ta.output.ndim == 2 else "output real positions"
    parts.append((what, err <= tol, f"max change {err:.2g} (tol {tol:g}) with {int(pad.sum())} padded tokens changed"))
    return _result("padding_invariance", parts)


def sublayer_ablation(model: nn.Module, variables: Any, batch: Batch, *, tol: float = 1e-4) -> CheckResult:
    """Zero one branch's last projection: each block must equal identity + the other branch
    (Pre-LN: y = x + S(LN(x)); Post-LN: y = LN2(LN1(x) + FFN) or LN2(LN1(x + MHA)))."""
    model, v = prepare(model, variables)
    cfg = _block_config(model)
    valid = batch["valid_tokens"]
    layers = _layer_dicts(v["params"])
    parts = []
    for branch, other in (("attention", "ffn_branch"), ("ffn", "attn_branch")):
        mod = _BRANCH_OUT[branch][0]
        if not all(mod in layers[i] for i in layers):
            parts.append((f"zero {branch}", True, "the blocks have no such branch (ablated by config)"))
            continue
        t = trace(model, _zero_branch(v, branch), batch)
        errs = []
        for i, rec in enumerate(t.records):
            x, y, s = _real(t.inputs[i], valid), _real(t.outputs[i], valid), _real(rec[other], valid)
            if cfg.norm == "pre":
                expected = x + s
            elif branch == "attention":
                expected = _norm(_norm(x, layers[i]["attn_norm"], cfg) + s, layers[i]["ffn_norm"], cfg)
            else:
                expected = _norm(_norm(x + s, layers[i]["attn_norm"], cfg), layers[i]["ffn_norm"], cfg)
            errs.append(_rel_err(y, expected))
        worst = max(errs, default=0.0)
        parts.append((f"zero {branch}: block = identity + {other}", worst <= tol,
                      f"max error {worst:.2g} (tol {tol:g}) per layer: {_fmt_list(errs)}"))
    return _result("sublayer_ablation", parts)


def structure(model: nn.Module, variables: Any, batch: Batch, *, seed: int = 0, tol: float = 1e-4,
              norm_tol: float = 2e-2) -> CheckResult:
    """Two distinct norm instances each applied to its own input; with both branches zeroed a
    Pre-LN block is the identity; a Pre-LN stack's output and every Post-LN block's output are
    normalized per token."""
    model, v = prepare(model, variables)
    cfg = _block_config(model)
    valid = batch["valid_tokens"]
    layers = _layer_dicts(v["params"])
    parts: list[tuple[str, bool, str]] = []

    # Distinct random affine params per instance: a shared or misplaced norm then shows in the values.
    missing = [f"layers_{i}/{n}" for i in layers for n in ("attn_norm", "ffn_norm") if n not in layers[i]]
    if missing:
        parts.append(("two norm instances per block", False,
                      f"{', '.join(missing)} missing: give each sublayer its own norm"))
    else:
        keys = iter(jax.random.split(jax.random.key(seed), 4 * len(layers)))

        def randomize(_: int, layer: dict[str, Any]) -> dict[str, Any]:
            for n in ("attn_norm", "ffn_norm"):
                p = dict(layer[n])
                p["scale"] = jax.random.uniform(next(keys), p["scale"].shape, p["scale"].dtype, 0.5, 1.5)
                if "bias" in p:
                    p["bias"] = jax.random.normal(next(keys), p["bias"].shape, p["bias"].dtype) * 0.5
                layer[n] = p
            return layer

        rv = _with_layer_params(v, randomize)
        rlayers = _layer_dicts(rv["params"])
        t = trace(model, rv, batch)
        errs = []
        for i, rec in enumerate(t.records):
            x = _real(t.inputs[i], valid)
            in1, in2 = (x, _real(rec["after_attn"], valid)) if cfg.norm == "pre" else (
                _real(rec["after_attn"], valid), _real(rec["after_ffn"], valid))
            errs.append(max(_rel_err(_real(rec["norm1"], valid), _norm(in1, rlayers[i]["attn_norm"], cfg)),
                            _rel_err(_real(rec["norm2"], valid), _norm(in2, rlayers[i]["ffn_norm"], cfg))))
        worst = max(errs, default=0.0)
        parts.append(("norm1 = attn_norm(its input), norm2 = ffn_norm(its input)", worst <= tol,
                      f"max error {worst:.2g} (tol {tol:g}) per layer: {_fmt_list(errs)}"))

    if cfg.norm == "pre":
        t = trace(model, _zero_branch(_zero_branch(v, "attention"), "ffn"), batch)
        errs = [_rel_err(_real(y, valid), _real(x, valid)) for x, y in zip(t.inputs, t.outputs, strict=True)]
        worst = max(errs, default=0.0)
        parts.append(("both branches zeroed: each Pre-LN block is the identity", worst <= tol,
                      f"max |y - x| {worst:.2g} (tol {tol:g}) per layer: {_fmt_list(errs)}"))
        stack = _stack_params(v["params"])
        t = trace(model, v, batch)
        if "final_norm" not in stack:
            parts.append(("Pre-LN stack output normalized per token", False,
                          "no final_norm: a Pre-LN stack needs one (final_norm=True or None)"))
        elif t.stack_output is None:
            parts.append(("Pre-LN stack output normalized per token", False, "the stack output was not seen"))
        else:
            err = _unnormalized_error(_real(t.stack_output, valid), stack["final_norm"], cfg)
            parts.append(("Pre-LN stack output normalized per token", err <= norm_tol,
                          f"max |mean|, |rms - 1| after undoing final_norm's affine: {err:.2g} (tol {norm_tol:g})"))
    else:
        t = trace(model, v, batch)
        errs = [_unnormalized_error(_real(y, valid), layers[i].get("ffn_norm"), cfg) for i, y in enumerate(t.outputs)]
        worst = max(errs, default=0.0)
        parts.append(("each Post-LN block output normalized per token", worst <= norm_tol,
                      f"max |mean|, |rms - 1| {worst:.2g} (tol {norm_tol:g}) per layer: {_fmt_list(errs)}"))
    return _result("structure", parts)


def train_eval_determinism(model: nn.Module, variables: Any, batch: Batch, *, seed: int = 0) -> CheckResult:
    """Eval repeats exactly; training repeats with the same dropout key and, when any dropout rate
    is positive, differs between keys and from eval (with none, training equals eval)."""
    model, v = prepare(model, variables)
    cfg, bcfg = model.config, _block_config(model)
    rates = [bcfg.attn_dropout, bcfg.ffn_dropout, bcfg.residual_dropout, getattr(cfg, "embed_dropout", 0.0)]
    k1, k2 = jax.random.split(jax.random.key(seed))

    def run(train: bool, key: jax.Array | None = None) -> np.ndarray:
        return _np(trace(model, v, batch, train=train, rngs={"dropout": key} if train else None).output)

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
        err = _rel_err(t1, e1)
        parts.append(("no dropout configured: train equals eval", err <= 1e-6, f"max difference {err:.2g}"))
    return _result("train_eval_determinism", parts)


@dataclass
class Diagnosis:
    """Every check and measurement on one model, variables and batch."""

    ratios: ResidualRatios
    grads: GradNorms
    nonfinite: NonFinite
    checks: list[CheckResult]

    @property
    def results(self) -> list[Any]:
        return [self.nonfinite, *self.checks, self.ratios, self.grads]

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if not r.passed]


def run_all(model: nn.Module, variables: Any, batch: Batch, loss_fn: LossFn, *,
            residual_ratio_limit: float = 10.0) -> Diagnosis:
    """Every check on one model: the whole debugging path in one call."""
    checks = [fn(model, variables, batch) for fn in
              (padding_invariance, sublayer_ablation, structure, train_eval_determinism)]
    return Diagnosis(
        residual_ratios(model, variables, batch, limit=residual_ratio_limit),
        grad_norms_by_depth(model, variables, batch, loss_fn),
        first_nonfinite(model, variables, batch),
        checks,
    )
