"""The two implementations under test, built from one config and one set of weights.

Ours: `jaxblock.EncoderStack` with a jitted training step (the trainer's `train.loop.step.gradient_step`:
forward, backward, global-norm clipping at 1.0, AdamW lr 1e-4 / weight decay 0.01 on every parameter,
the state donated) and a jitted
forward for inference. Theirs: `torch.nn.TransformerEncoder` built by `jaxblock.interop.torch.to_torch`
from the very same parameters, trained eagerly (optionally through `torch.compile`) with the same
loss, clipping and AdamW settings (PyTorch's fused AdamW kernel where its build has one: the
strongest baseline, not the default per-tensor loop). The loss is mean(y²) over the stack output: no
embedding or head, so the block itself is what is timed. Dropout is 0 on both sides (PyTorch's fast
path and our fused attention both require it).

Shapes: x float32[N, L, D]; valid_tokens bool[N, L] (True = real token, real tokens first).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import jaxblock
from jaxblock.config import BlockConfig, StackConfig
from jaxblock.model import stack_layer_params
from train.loop.step import gradient_step

LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: batch N, length L, width D, heads H, FFN width F, and `k` layers (the tables'
    column K; a name the benchmarks keep for their records, not the head width of jaxblock's docstrings)."""

    n: int
    length: int
    d: int
    h: int
    f: int
    k: int

    def as_dict(self) -> dict[str, int]:
        return {"N": self.n, "L": self.length, "D": self.d, "H": self.h, "F": self.f, "B": self.k}

    @property
    def label(self) -> str:
        return f"N{self.n} L{self.length} D{self.d} B{self.k}"


def stack_config(shape: Shape, norm: str = "pre", *, scan: bool = False, remat: str = "none",
                 **block: Any) -> StackConfig:
    """PyTorch-compatible block (exact GELU, eps 1e-5, torch init) with benchmark options on top."""
    cfg = BlockConfig(model_dim=shape.d, num_heads=shape.h, ffn_dim=shape.f, norm=norm, activation="gelu",
                      init="torch", **block)
    return StackConfig(num_layers=shape.k, scan_layers=scan, remat=remat, block=cfg)


def make_inputs(shape: Shape, padding: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """x float32[N, L, D] ~ N(0, 1) and valid_tokens bool[N, L] with `padding` of all positions padded.

    Row i keeps L - round(2·padding·L·i/(N-1)) tokens: lengths fall evenly from L, so the mean
    padded fraction is `padding` and every row keeps at least (1 - 2·padding)·L tokens.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((shape.n, shape.length, shape.d), dtype=np.float32)
    steps = np.arange(shape.n) / max(shape.n - 1, 1)
    lengths = shape.length - np.round(2 * padding * shape.length * steps).astype(int)
    valid = np.arange(shape.length)[None, :] < np.maximum(lengths, 1)[:, None]  # [N, L]
    return x, valid


def init_params(cfg: StackConfig, shape: Shape, seed: int = 0) -> Any:
    """Plain per-layer float32 params (layers_0, layers_1, ... one per layer); `params_for` adapts them to a config."""
    flat = cfg.model_copy(update={"scan_layers": False})
    x = jnp.zeros((1, min(shape.length, 8), shape.d), jnp.float32)
    variables = jaxblock.EncoderStack(flat).init(jax.random.key(seed), x, jnp.ones(x.shape[:2], bool))
    return nn.unbox(variables)["params"]


def params_for(cfg: StackConfig, params: Any) -> Any:
    """The same weights in the layout this config's module expects (stacked on a leading layers axis for scan)."""
    return stack_layer_params(params) if cfg.scan_layers else params


def _optimizer() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WEIGHT_DECAY))


class OursTrain:
    """A compiled training step; each call runs one step on the fixed batch and blocks until done."""

    def __init__(self, cfg: StackConfig, params: Any, x: np.ndarray, valid: np.ndarray, *, donate: bool = True,
                 compiler_options: dict[str, Any] | None = None):
        model = jaxblock.EncoderStack(cfg)

        def step(state: TrainState, x: jax.Array, valid: jax.Array) -> tuple[TrainState, jax.Array]:
            def loss_fn(p: Any) -> tuple[jax.Array, None]:
                y = cast(jax.Array, state.apply_fn({"params": p}, x, valid, train=True))  # [N, L, D]
                return jnp.mean(jnp.square(y.astype(jnp.float32))), None

            state, loss, _, _ = gradient_step(state, loss_fn)
            return state, loss

        p = jax.tree.map(jnp.array, params_for(cfg, params))  # a private copy: donation consumes it
        self.state = TrainState.create(apply_fn=model.apply, params=p, tx=_optimizer())
        self.x, self.valid = jnp.asarray(x), jnp.asarray(valid)
        start = time.perf_counter()
        self.lowered = jax.jit(step, donate_argnums=(0,) if donate else ()).lower(self.state, self.x, self.valid)
        self.lower_s = time.perf_counter() - start  # tracing + lowering to StableHLO
        self.compiled = self.lowered.compile(compiler_options=compiler_options)
        self.compile_s = time.perf_counter() - start - self.lower_s  # XLA's optimization and code generation
        self.loss = jnp.zeros(())

    def __call__(self) -> None:
        self.state, self.loss = self.compiled(self.state, self.x, self.valid)
        self.loss.block_until_ready()


class OursInfer:
    """A compiled eval-mode forward (train=False, no gradients) on the fixed batch."""

    def __init__(self, cfg: StackConfig, params: Any, x: np.ndarray, valid: np.ndarray):
        model = jaxblock.EncoderStack(cfg)
        self.params = jax.tree.map(jnp.asarray, params_for(cfg, params))
        self.x, self.valid = jnp.asarray(x), jnp.asarray(valid)

        def forward(p: Any, x: jax.Array, valid: jax.Array) -> jax.Array:
            return cast(jax.Array, model.apply({"params": p}, x, valid))

        self.compiled = jax.jit(forward).lower(self.params, self.x, self.valid).compile()
        self.out = self.compiled(self.params, self.x, self.valid)

    def __call__(self) -> None:
        self.out = self.compiled(self.params, self.x, self.valid)
        self.out.block_until_ready()


# --- PyTorch ------------------------------------------------------------------------------------


def torch_module(cfg: StackConfig, params: Any, *, nested: bool = False) -> Any:
    """nn.TransformerEncoder holding our exact weights (batch_first: it takes [N, L, D] as ours does)."""
    from jaxblock.interop.torch import to_torch

    flat = cfg.model_copy(update={"scan_layers": False, "remat": "none",
                                  "block": cfg.block.model_copy(update={"dtype": "float32"})})
    return to_torch(flat, {"params": params}, batch_first=True, enable_nested_tensor=nested)


class TorchTrain:
    """PyTorch eager (or torch.compile'd) training step with the same loss, clipping and AdamW."""

    def __init__(self, module: Any, x: np.ndarray, *, compiled: bool = False, device: str = "cpu",
                 autocast: Any = None):
        import torch

        self.torch = torch
        self.module = module.to(device).train()
        self.forward = torch.compile(self.module) if compiled else self.module
        try:  # PyTorch's fastest AdamW (one fused kernel; ~9x the default per-tensor loop on CPU)
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
            self.optimizer = "AdamW(fused=True)"
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(self.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            self.optimizer = "AdamW"
        self.x = torch.from_numpy(np.array(x)).to(device)
        self.autocast = autocast
        self.device = device

    def __call__(self) -> None:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device, dtype=self.autocast, enabled=self.autocast is not None):
            y = self.forward(self.x)
        loss = torch.mean(torch.square(y.float()))
        loss.backward()
        self.loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), CLIP)
        self.opt.step()
        if self.device != "cpu":
            torch.cuda.synchronize()


class TorchInfer:
    """PyTorch inference as its docs advise for speed: eval(), inference_mode, a key padding mask
    (the fast path, on nested tensors when the module allows them)."""

    def __init__(self, module: Any, x: np.ndarray, valid: np.ndarray, *, device: str = "cpu", autocast: Any = None):
        import torch

        self.torch = torch
        self.module = module.to(device).eval()
        self.x = torch.from_numpy(np.array(x)).to(device)
        warnings.filterwarnings("ignore", message=".*nested tensors is in prototype.*")
        self.pad = torch.from_numpy(~np.asarray(valid, bool)).to(device)  # PyTorch: True = ignore
        self.device, self.autocast = device, autocast

    @property
    def nested(self) -> tuple[bool, str]:
        """Whether the nested-tensor fast path is on, and PyTorch's reason when it is not."""
        on = bool(getattr(self.module, "use_nested_tensor", False))
        if on:
            return True, "nested tensors on"
        layers = getattr(self.module, "layers", [])
        if layers and layers[0].norm_first:
            return False, "nested tensors off: PyTorch allows them only with norm_first=False"
        return False, "nested tensors off"

    def __call__(self) -> None:
        torch = self.torch
        with torch.inference_mode(), torch.autocast(self.device, dtype=self.autocast,
                                                    enabled=self.autocast is not None):
            self.out = self.module(self.x, src_key_padding_mask=self.pad)
        if self.device != "cpu":
            torch.cuda.synchronize()


def max_abs_diff(ours: Any, theirs: Any, valid: np.ndarray) -> float:
    """Largest |ours - theirs| over real positions (PyTorch's nested path zeroes the padded ones; its
    TransformerEncoder returns them padded back to the input's shape)."""
    a = np.asarray(jax.device_get(ours), np.float32)
    b = theirs.detach().float().cpu().numpy()
    v = np.asarray(valid, bool)
    return float(np.max(np.abs(a[v] - b[v]))) if v.any() else 0.0
