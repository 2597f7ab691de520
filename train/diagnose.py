"""`python -m train diagnose --config C [--workdir W] [--out DIR] [key.path=value ...]`

Runs every check of the debugging path (jaxblock.diagnostics) on the freshly initialised model of the
config's task (train/tasks/), or on a trained run's checkpoint (--workdir), with the task's loss, over
one batch of the config's validation data (or, for classification, of random tokens with --random), and
writes DIR/report.md with DIR/residual_ratios.png and
DIR/grad_norms.png.

Exit codes: 0 every check passed; 1 a check failed (named on stderr); 2 bad input (one line on
stderr, nothing written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NoReturn

import jax
import numpy as np

from jaxblock import diagnostics as dg
from jaxblock.masks import lengths_to_valid_tokens
from train.config import Config, ConfigError, load_config
from train.data.datasets import DataError
from train.errors import FAILED_EXIT, USAGE_EXIT, UsageError
from train.loop.state import init_params
from train.tasks import CLASSIFICATION, Task, task_for


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m train diagnose",
                description="Run the debugging-path checks on a config's model or a checkpoint; write a report.")
    p.add_argument("--config", help="YAML config (see configs/); optional with --workdir")
    p.add_argument("--workdir", help="a trained run: diagnose its checkpoint (its saved config wins)")
    p.add_argument("--out", help="report directory (default: WORKDIR/diagnose, else runs/diagnose/<config name>)")
    p.add_argument("--batch-size", type=int, default=16, help="examples in the diagnosed batch")
    p.add_argument("--seed", type=int, default=0, help="init seed (without --workdir) and batch seed")
    p.add_argument("--random", action="store_true", help="random tokens instead of the config's data")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. model.num_layers=6")
    return p


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.batch_size < 1:
            raise UsageError("--batch-size must be at least 1: pass e.g. --batch-size 16")
        config, params, tokenizer_dir = _load(args)
        task = task_for(config)
        batch = _batch(config, tokenizer_dir, args.batch_size, args.seed, args.random, task)
    except (UsageError, ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return USAGE_EXIT
    out = Path(args.out) if args.out else (
        Path(args.workdir) / "diagnose" if args.workdir else Path("runs/diagnose") / Path(args.config).stem)
    title = f"checkpoint in {args.workdir}" if args.workdir else f"{args.config} at initialization (seed {args.seed})"
    return diagnose(task.build_model(config.model), {"params": params}, batch, out, title=title,
                    residual_ratio_limit=config.diagnostics.residual_ratio_limit, loss=task.loss)


def _load(args: argparse.Namespace) -> tuple[Config, Any, Path | None]:
    if args.workdir:
        from train.checkpoints.restore import restore_run
        from train.checkpoints.store import TOKENIZER_DIR, CheckpointError

        try:  # as evaluate does: a damaged checkpoint is named and the newest that restores is used
            run = restore_run(Path(args.workdir))
        except CheckpointError as err:
            raise UsageError(str(err)) from None
        for note in run.notes:
            print(f"note: {note}", file=sys.stderr)
        return run.config, run.params, Path(args.workdir) / TOKENIZER_DIR
    if not args.config:
        raise UsageError("diagnose needs --config C (a fresh model) or --workdir W (a trained run)")
    config = load_config(args.config, args.overrides)
    model = task_for(config).build_model(config.model)
    return config, init_params(model, args.seed, min(config.model.max_len, config.data.buckets[-1])), None


def _batch(config: Config, tokenizer_dir: Path | None, size: int, seed: int, random: bool,
           task: Task = CLASSIFICATION) -> dict[str, Any]:
    """A batch of `size` rows: the config's validation data, or (classification) random tokens with ragged
    lengths and random labels."""
    if not task.predicts_labels:  # the task's own validation batch, its first `size` rows
        if random:
            raise UsageError(f"--random makes class-labelled batches; a task={task.name} run is diagnosed on its "
                             "validation data: drop --random")
        task_data = task.load_data(config, tokenizer_dir=tokenizer_dir)
        first = next(iter(task.make_batches(task_data, config, training=False).eval_batches("validation")))
        return {k: jax.numpy.asarray(v[:size]) for k, v in first.items()}
    if not random:
        from train.data import labelled as data

        dataset = data.load_dataset(config.data, tokenizer_dir=tokenizer_dir)
        b = data.train_batch(dataset.validation, seed=seed, step=0, batch_size=size, buckets=config.data.buckets)
        return {k: jax.numpy.asarray(v) for k, v in b.items()}
    rng = np.random.default_rng(seed)
    length = min(config.model.max_len, config.data.buckets[-1])
    lengths = rng.integers(max(length // 2, 1), length + 1, size)
    lengths[0] = length
    return {
        "tokens": jax.numpy.asarray(rng.integers(0, config.model.vocab_size, (size, length)), np.int32),
        "valid_tokens": lengths_to_valid_tokens(lengths, length),
        "labels": jax.numpy.asarray(rng.integers(0, config.model.num_classes, size), np.int32),
    }


def diagnose(model: Any, variables: Any, batch: dict[str, Any], out: Path, *, title: str,
             residual_ratio_limit: float = 10.0, loss: Any = CLASSIFICATION.loss) -> int:
    """Run every check on `model` (any class the diagnostics accept) with the task's `loss`, write the
    report; the exit code."""

    result = dg.run_all(model, variables, batch, loss, residual_ratio_limit=residual_ratio_limit)
    out.mkdir(parents=True, exist_ok=True)
    _plot_ratios(result.ratios, out / "residual_ratios.png")
    _plot_grads(result.grads, out / "grad_norms.png")
    (out / "report.md").write_text(report(result, model, batch, title))
    if result.failed:
        failed = {r.name: r for r in result.results if not r.passed}
        first = next(iter(failed.values()))
        print(f"diagnose: check '{first.name}' failed: {first.summary()} "
              f"({len(failed)} failed: {', '.join(failed)}; report: {out / 'report.md'})", file=sys.stderr)
        return FAILED_EXIT
    print(f"diagnose: all {len(result.results)} checks passed; report: {out / 'report.md'}")
    return 0


def report(result: dg.Diagnosis, model: Any, batch: dict[str, Any], title: str) -> str:
    cfg = model.config
    blk = getattr(cfg, "block", cfg)
    valid = np.asarray(batch["valid_tokens"])
    lines = [
        f"# Diagnostics: {title}", "",
        f"{type(model).__name__}: {getattr(cfg, 'num_layers', '?')} layers, {blk.norm}-LN ({blk.norm_type}), "
        f"D={blk.model_dim}, H={blk.num_heads}, F={blk.ffn_dim}, activation {blk.activation}. "
        f"Batch: N={valid.shape[0]}, L={valid.shape[1]}, {int(valid.sum())} real and {int((~valid).sum())} "
        "padded tokens (padding_invariance pads half of every other row when the batch has no padding).", "",
        "## Checks", "", "| check | result | summary |", "| --- | --- | --- |",
    ]
    for r in result.results:
        lines.append(f"| `{r.name}` | {'PASS' if r.passed else '**FAIL**'} | {r.summary()} |")
    lines += ["", "## Residual ratios by layer", "",
              "||branch|| / ||residual input|| over real tokens (Pre-LN: ||S(LN(x))||/||x||; "
              f"Post-LN: ||S(x)||/||x||); the limit is {result.ratios.limit:g}.", "",
              "![residual ratios by layer](residual_ratios.png)", "",
              "| layer | attention | FFN |", "| ---: | ---: | ---: |"]
    lines += [f"| {i} | {a:.4g} | {f:.4g} |" for i, (a, f) in enumerate(zip(result.ratios.attn, result.ratios.ffn,
                                                                             strict=True))]
    g = result.grads
    lines += ["", "## Gradient norms by depth", "", f"Eval-mode cross-entropy {g.loss:.4g} on this batch.", "",
              "![gradient norms by depth](grad_norms.png)", "",
              "| layer | at layer input | layer params | ffn/linear2/kernel |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {i} | {a:.4g} | {p:.4g} | {k:.4g} |"
              for i, (a, p, k) in enumerate(zip(g.input_grad, g.param_grad, g.ffn_out_kernel_grad, strict=True))]
    lines += ["", "## Details", "", "```text", *(str(r) for r in result.results), "```", ""]
    return "\n".join(lines)


def _plot_ratios(r: dg.ResidualRatios, path: Path) -> None:
    _plot_by_layer(path, {("attention", "o-"): r.attn, ("FFN", "s-"): r.ffn}, "||branch|| / ||residual input||",
                   f"Residual ratios ({r.placement}-LN)", limit=r.limit)


def _plot_grads(g: dg.GradNorms, path: Path) -> None:
    _plot_by_layer(path, {("at layer input", "o-"): g.input_grad, ("layer params", "s-"): g.param_grad,
                          ("ffn/linear2/kernel", "^-"): g.ffn_out_kernel_grad},
                   "gradient norm", "Gradient norm by depth")


def _plot_by_layer(path: Path, series: dict[tuple[str, str], Any], ylabel: str, title: str,
                   limit: float | None = None) -> None:
    """One log-scale line per (label, style) over the layers, and the limit as a red dotted line."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(5.5, 3.5), layout="constrained")
    ax = fig.subplots()
    layers = np.arange(len(next(iter(series.values()))))
    for (label, style), values in series.items():
        ax.plot(layers, values, style, label=label)
    if limit is not None:
        ax.axhline(limit, color="red", linestyle=":", label=f"limit {limit:g}")
    ax.set(xlabel="layer", ylabel=ylabel, yscale="log", title=title)
    ax.set_xticks(layers)
    ax.legend()
    fig.savefig(path, dpi=120)
