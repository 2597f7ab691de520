"""`python -m train study-ln [--out docs]`: Pre-LN vs Post-LN at depth 6, 12 and 24.

Same data, same seeds and so the same initial weights for both placements (the parameter trees are
identical; Pre-LN adds only the final norm). The data is generated here (`count_task`) and batched by
train/data/labelled.py: its own synthetic tasks relate position 0 to the rest of the row and, at these widths,
stay at chance for the few hundred steps a CPU study can afford, which would leave nothing to compare.

(a) At initialization, the gradient norm of each layer's FFN output kernel (ffn/linear2/kernel) by layer,
    averaged over seeds: Xiong et al. 2020 ("On Layer Normalization in the Transformer Architecture",
    Fig. 3) find Post-LN's growing toward the output layers and Pre-LN's flat.
(b) Training at one fixed peak learning rate, with and without linear warmup (then linear decay to 0,
    the project's `schedule: linear`): Adam (b1 0.9, b2 0.98), no clipping, no weight decay; a verdict
    per run.

Writes OUT/study_grad_norms.png, OUT/study_loss_curves.png, OUT/study_ln.md (tables) and
OUT/study_ln.json (every number). Exit 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from jaxblock import diagnostics as dg
from jaxblock.config import EncoderConfig
from jaxblock.model import Classifier, stack_layer_params
from train.config import OptimConfig
from train.data import labelled as data
from train.diagnose import Parser, UsageError
from train.loop.state import init_params, make_schedule
from train.loop.step import gradient_step
from train.study_report import PLACEMENTS, smooth, write
from train.tasks import CLASSIFICATION


@dataclass(frozen=True)
class Settings:
    depths: tuple[int, ...] = (6, 12, 24)
    width: int = 32  # D
    ffn_dim: int = 128  # F = 4D
    heads: int = 4
    length: int = 16  # L: the synthetic rows' length
    vocab: int = 16  # symbols of the synthetic task
    examples: int = 4000
    batch_size: int = 32
    steps: int = 150
    warmup: int = 50
    lr: float = 3e-3
    seeds: tuple[int, ...] = (0, 1, 2)  # part (b): one run per seed (init and batch order)
    grad_seeds: tuple[int, ...] = (0, 1, 2)  # part (a): mean over these inits
    data_seed: int = 0  # the data set itself, the same for every run


def _parser() -> argparse.ArgumentParser:
    d = Settings()
    p = Parser(prog="python -m train study-ln", description="Pre-LN vs Post-LN: init gradients and warmup.")
    p.add_argument("--out", default="docs", help="where the figures, study_ln.md and study_ln.json go")
    p.add_argument("--depths", type=int, nargs="+", default=list(d.depths))
    p.add_argument("--width", type=int, default=d.width, help="D")
    p.add_argument("--ffn-dim", type=int, help="F (default 4D)")
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--examples", type=int, default=d.examples, help="synthetic examples (train/val/test 80/10/10)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps of the warmup runs")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate, shared by every run")
    p.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds), help="training runs per setting")
    p.add_argument("--grad-seeds", type=int, nargs="+", default=list(d.grad_seeds))
    return p


def main(argv: list[str]) -> int:
    try:
        a = _parser().parse_args(argv)
        s = Settings(tuple(a.depths), a.width, a.ffn_dim or 4 * a.width, a.heads, examples=a.examples,
                     batch_size=a.batch_size, steps=a.steps, warmup=a.warmup, lr=a.lr, seeds=tuple(a.seeds),
                     grad_seeds=tuple(a.grad_seeds))
        _validate(s)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    result = run(s, log=lambda line: print(line, flush=True))
    result["wall_seconds"] = time.perf_counter() - start
    out = Path(a.out)
    write(result, out)
    print(f"study-ln: done in {result['wall_seconds']:.0f} s; wrote {out}/study_ln.md, study_grad_norms.png, "
          "study_loss_curves.png")
    return 0


def _validate(s: Settings) -> None:
    if min(s.depths) < 1 or s.steps < 2 or s.warmup < 1 or s.warmup >= s.steps or s.lr <= 0:
        raise UsageError(f"need depths >= 1, steps >= 2, 1 <= warmup < steps, lr > 0; got depths {s.depths}, "
                         f"steps {s.steps}, warmup {s.warmup}, lr {s.lr}")
    if s.width % s.heads:
        raise UsageError(f"--width {s.width} is not divisible by --heads {s.heads}: pick a divisor")
    if s.examples < 20 or s.batch_size < 1:
        raise UsageError(f"need --examples >= 20 (10% validate) and --batch-size >= 1; got {s.examples}, "
                         f"{s.batch_size}")


def model_config(s: Settings, depth: int, placement: str, vocab_size: int) -> EncoderConfig:
    return EncoderConfig(
        num_layers=depth, vocab_size=vocab_size, max_len=s.length, num_classes=2, scan_layers=True,
        block=dict(model_dim=s.width, num_heads=s.heads, ffn_dim=s.ffn_dim, norm=placement),
    )


def run(s: Settings, log: Any = print) -> dict[str, Any]:
    """Both parts; every number the figures and tables show."""
    ds = count_task(s)
    vocab_size = s.vocab + 1
    grads: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    batch0 = _batch(ds[0], s, s.data_seed, 0)
    for depth in s.depths:
        for placement in PLACEMENTS:
            model = Classifier(model_config(s, depth, placement, vocab_size))
            init = initializer(model, s)
            per_seed = [_init_grads(model, init(seed), batch0) for seed in s.grad_seeds]
            grads[f"{placement}/{depth}"] = np.mean(per_seed, axis=0).tolist()
            log(f"(a) depth {depth:2d} {placement}-LN: ffn/linear2 grad norm by layer "
                + " ".join(f"{g:.3g}" for g in grads[f"{placement}/{depth}"]))
        for placement in PLACEMENTS:
            model = Classifier(model_config(s, depth, placement, vocab_size))
            init = initializer(model, s)
            step = _make_step(model)
            forward = jax.jit(lambda p, t, v, model=model: model.apply({"params": p}, t, v))
            for seed in s.seeds:
                for warm in (True, False):
                    t0 = time.perf_counter()
                    r = _train(init(seed), step, forward, ds, s, seed, warm)
                    r.update(depth=depth, placement=placement, seed=seed, warmup=s.warmup if warm else 0,
                             seconds=time.perf_counter() - t0)
                    runs.append(r)
                    log(f"(b) depth {depth:2d} {placement}-LN seed {seed} warmup {r['warmup']:3d}: {r['verdict']:9s} "
                        f"final loss {r['final_loss']:.3f}, val acc {r['val_accuracy']:.3f} ({r['seconds']:.0f} s)")
    return {"settings": asdict(s), "grad_norms": grads, "runs": runs}


def count_task(s: Settings) -> tuple[data.Split, data.Split]:
    """(train, validation): rows of L/2..L symbols; label 1 iff symbol 0 occurs more often than symbol 1.

    Ties are dropped and the labels balanced. Token id = symbol + 1 (0 pads). A bag-of-tokens task, so
    every model can learn it within the study's step budget and what separates the runs is optimization.
    """
    rng = np.random.default_rng([s.data_seed, 0xC0])
    rows = rng.integers(0, s.vocab, (4 * s.examples, s.length))
    lengths = rng.integers(s.length // 2, s.length + 1, 4 * s.examples)
    real = np.arange(s.length)[None, :] < lengths[:, None]  # [E, L]
    diff = np.sum((rows == 0) & real, 1) - np.sum((rows == 1) & real, 1)
    half = s.examples // 2
    ones, zeros = np.flatnonzero(diff > 0)[:half], np.flatnonzero(diff < 0)[:half]
    order = rng.permutation(np.concatenate([ones, zeros]))
    tokens = [(rows[i, : lengths[i]] + 1).astype(np.int32) for i in order]
    labels = (diff[order] > 0).astype(np.int32)
    cut = len(order) * 9 // 10
    return (data.Split(tokens[:cut], labels[:cut], []), data.Split(tokens[cut:], labels[cut:], []))


def _batch(split: data.Split, s: Settings, seed: int, step: int) -> dict[str, jax.Array]:
    b = data.train_batch(split, seed=seed, step=step, batch_size=s.batch_size, buckets=[s.length])
    return {k: jnp.asarray(v) for k, v in b.items()}


def initializer(model: Classifier, s: Settings) -> Any:
    """seed -> params of the scanned model, initialised through its unrolled twin and stacked.

    Op by op, the unrolled init reuses the same compiled ops at every depth; compiling the scanned
    init would cost seconds per model.
    """
    unrolled = Classifier(model.config.model_copy(update={"scan_layers": False}))
    return lambda seed: stack_layer_params(init_params(unrolled, seed, s.length))


def _init_grads(model: Classifier, params: Any, batch: dict[str, jax.Array]) -> list[float]:
    return dg.grad_norms_by_depth(model, {"params": params}, batch, CLASSIFICATION.loss).ffn_out_kernel_grad


# Adam without its learning rate; the step scales the update by an lr argument, so both schedules share
# one compiled step.
_ADAM = optax.scale_by_adam(b1=0.9, b2=0.98, eps=1e-8)


def _make_step(model: Classifier) -> Any:
    """One compiled step per model through the trainer's `gradient_step`: (state, batch, lr) -> (state, loss)."""

    @jax.jit
    def step(state: TrainState, batch: dict[str, jax.Array], lr: jax.Array) -> tuple[TrainState, jax.Array]:
        def loss_fn(p: Any) -> tuple[jax.Array, None]:
            return CLASSIFICATION.loss(CLASSIFICATION.apply(model.apply, p, batch, train=True, rng=None), batch), None

        # The optimizer closes over this trace's lr; it lives only inside the step (replaced on return).
        tx = optax.chain(_ADAM, optax.scale(-lr))
        state, loss, _, _ = gradient_step(state.replace(tx=tx), loss_fn)
        return state.replace(tx=_ADAM), loss

    return step


def initial_state(params: Any) -> TrainState:
    """The step's state: the params and the optimizer state of Adam followed by a (stateless) lr scale."""
    return TrainState.create(apply_fn=None, params=params, tx=optax.chain(_ADAM, optax.scale(-1.0))).replace(tx=_ADAM)


def schedule(s: Settings, warm: bool) -> optax.Schedule:
    """The project's schedule: linear warmup from 0 (or none), then linear decay to 0 at the last step."""
    return make_schedule(OptimConfig(lr=s.lr, warmup_steps=s.warmup if warm else 0, schedule="linear"), s.steps)


def _train(params: Any, step: Any, forward: Any, ds: tuple[data.Split, data.Split], s: Settings, seed: int,
           warm: bool) -> dict[str, Any]:
    state = initial_state(params)
    losses: list[float] = []
    lr = schedule(s, warm)
    for t in range(s.steps):
        state, loss = step(state, _batch(ds[0], s, seed, t), jnp.float32(lr(t)))
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            break
    params = state.params
    accuracy = _accuracy(forward, params, ds[1], s) if math.isfinite(losses[-1]) else float("nan")
    return {"losses": losses, "final_loss": final_loss(losses), "val_accuracy": accuracy,
            "verdict": verdict(losses, accuracy, 2)}


def final_loss(losses: list[float]) -> float:
    """Mean loss over the last tenth of the run (at least one step)."""
    return float(np.mean(losses[-max(len(losses) // 10, 1):]))


def verdict(losses: list[float], accuracy: float, classes: int) -> str:
    """The fate of a run, from its losses (moving mean of 10) and validation accuracy:

    diverged: a non-finite loss, a final loss well above chance, or a run that learned (loss below half
    of chance) and fell back to chance; stalled: never left chance; converged: validation accuracy
    >= 0.9; learning: in between.
    """
    chance = math.log(classes)
    if not all(math.isfinite(x) for x in losses):
        return "diverged"
    curve = smooth(losses)
    final = final_loss(losses)
    if final > 1.2 * chance or (final > 0.9 * chance and curve.min() < 0.5 * chance):
        return "diverged"
    if final > 0.9 * chance or not accuracy > 0.6:
        return "stalled"
    return "converged" if accuracy >= 0.9 else "learning"


def _accuracy(forward: Any, params: Any, split: data.Split, s: Settings) -> float:
    correct = count = 0
    for b in data.eval_batches(split, batch_size=s.batch_size, buckets=[s.length]):
        logits = np.asarray(forward(params, jnp.asarray(b["tokens"]), jnp.asarray(b["valid_tokens"])))
        real = b["labels"] >= 0
        correct += int(np.sum((logits.argmax(-1) == b["labels"]) & real))
        count += int(real.sum())
    return correct / max(count, 1)
