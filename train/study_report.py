"""What `python -m train study-ln` writes: the tables (OUT/study_ln.md), every number (OUT/study_ln.json) and
the two plots (OUT/study_grad_norms.png, OUT/study_loss_curves.png), all from the result of train/study.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

PLACEMENTS = ("pre", "post")  # the placements the study compares (train/study.py runs them)


def smooth(losses: list[float], window: int = 10) -> np.ndarray:
    """Moving mean over `window` steps (fewer when the run is shorter)."""
    w = max(min(window, len(losses)), 1)
    return np.convolve(np.asarray(losses, np.float64), np.ones(w) / w, mode="valid")


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "study_ln.json").write_text(json.dumps(result, indent=1))
    (out / "study_ln.md").write_text(tables(result))
    _plot_grads(result, out / "study_grad_norms.png")
    _plot_losses(result, out / "study_loss_curves.png")


def tables(result: dict[str, Any]) -> str:
    s = result["settings"]
    g = result["grad_norms"]
    lines = [
        "(a) Gradient norm of ffn/linear2/kernel at initialization, first and last layer (mean over seeds "
        f"{', '.join(map(str, s['grad_seeds']))}), and Post-LN's over Pre-LN's.", "",
        "| depth | Pre-LN first | Pre-LN last | Post-LN first | Post-LN last | Post/Pre first | Post/Pre last |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for depth in s["depths"]:
        pre, post = g[f"pre/{depth}"], g[f"post/{depth}"]
        lines.append(f"| {depth} | {pre[0]:.3g} | {pre[-1]:.3g} | {post[0]:.3g} | {post[-1]:.3g} | "
                     f"{post[0] / pre[0]:.2f} | {post[-1] / pre[-1]:.2f} |")
    lines += [
        "", f"(b) Training at peak lr {s['lr']:g} for {s['steps']} steps (batch {s['batch_size']}), with "
        f"{s['warmup']} warmup steps or none, seeds {', '.join(map(str, s['seeds']))}; final loss = mean of the "
        "last 10% of steps, then averaged over seeds.", "",
        "| depth | placement | warmup | verdict per seed | final train loss | val accuracy |",
        "| ---: | --- | ---: | --- | ---: | ---: |",
    ]
    for (depth, placement, warmup), runs in _settings_runs(result).items():
        fates = [r["verdict"] for r in runs]
        fate = f"{fates[0]} (all {len(fates)})" if len(set(fates)) == 1 else ", ".join(fates)
        lines.append(f"| {depth} | {placement}-LN | {warmup} | {fate} | "
                     f"{np.mean([r['final_loss'] for r in runs]):.3f} | "
                     f"{np.mean([r['val_accuracy'] for r in runs]):.3f} |")
    if "wall_seconds" in result:
        lines += ["", f"Wall time of the whole study: {result['wall_seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


_COLORS = {"pre": "tab:blue", "post": "tab:orange"}


def _settings_runs(result: dict[str, Any]) -> dict[tuple[int, str, int], list[dict[str, Any]]]:
    """Runs grouped by (depth, placement, warmup), in the order they ran."""
    groups: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for r in result["runs"]:
        groups.setdefault((r["depth"], r["placement"], r["warmup"]), []).append(r)
    return groups


def _plot_grads(result: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    depths = result["settings"]["depths"]
    g = result["grad_norms"]
    fig = Figure(figsize=(3.6 * (len(depths) + 1), 3.4), layout="constrained")
    axes = fig.subplots(1, len(depths) + 1, squeeze=False)[0]
    for ax, depth in zip(axes, depths, strict=False):
        for placement in PLACEMENTS:
            ax.plot(np.arange(1, depth + 1), g[f"{placement}/{depth}"], "o-", ms=3, color=_COLORS[placement],
                    label=f"{placement}-LN")
        ax.set(title=f"{depth} layers", xlabel="layer", yscale="log")
        _plain_log_axis(ax)
        ax.legend()
    axes[0].set_ylabel("||grad ffn/linear2/kernel|| at init")
    ratio = axes[-1]
    for depth in depths:
        layers = np.arange(1, depth + 1)
        ratio.plot(layers / depth, np.asarray(g[f"post/{depth}"]) / np.asarray(g[f"pre/{depth}"]), "o-", ms=3,
                   label=f"{depth} layers")
    ratio.set(title="Post-LN / Pre-LN", xlabel="layer / depth", yscale="log")
    _plain_log_axis(ratio)
    ratio.legend()
    fig.suptitle("Gradient norm of each layer's FFN output weights at initialization")
    fig.savefig(path, dpi=120)


def _plain_log_axis(ax: Any) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _plot_losses(result: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    depths = result["settings"]["depths"]
    fig = Figure(figsize=(4.2 * len(depths), 3.6), layout="constrained")
    axes = fig.subplots(1, len(depths), squeeze=False)[0]
    groups = _settings_runs(result)
    for ax, depth in zip(axes, depths, strict=True):
        for (d, placement, warmup), runs in groups.items():
            if d != depth:
                continue
            curves = [smooth(r["losses"]) for r in runs]
            length = min(len(c) for c in curves)
            stack = np.stack([c[:length] for c in curves])  # [seeds, steps]
            steps = np.arange(len(runs[0]["losses"]) - length, len(runs[0]["losses"]))
            style = "-" if warmup else "--"
            label = f"{placement}-LN, {'warmup ' + str(warmup) if warmup else 'no warmup'}"
            ax.plot(steps, stack.mean(0), style, color=_COLORS[placement], label=label)
            ax.fill_between(steps, stack.min(0), stack.max(0), color=_COLORS[placement], alpha=0.12, linewidth=0)
        ax.axhline(math.log(2), color="gray", linestyle=":", linewidth=1)
        ax.set(title=f"{depth} layers", xlabel="step", ylim=(0, 1.2))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training loss (moving mean of 10)")
    fig.suptitle(f"Training at peak lr {result['settings']['lr']:g}: mean over seeds (band: min to max); "
                 "dotted: chance (ln 2)")
    fig.savefig(path, dpi=120)
