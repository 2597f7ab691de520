"""The end-of-session curves: `curves.png`, training and validation metrics by step from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from train.workdir.metrics_log import JSONL_FILE, read_jsonl

CURVES_FILE = "curves.png"


def plot_curves(workdir: Path, metrics: tuple[str, ...] = ("loss", "accuracy")) -> Path | None:
    """Training and validation curves of `metrics` by step, from metrics.jsonl, into curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(Path(workdir) / JSONL_FILE)
    if not records:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    for ax, name in zip(axes[0], metrics, strict=True):
        for split, style in (("train", "-"), ("val", "o-")):
            points = [(r["step"], r[name]) for r in records
                      if r["split"] == split and isinstance(r.get(name), float)]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(xs, ys, style, label=split, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(Path(workdir).name)
    fig.tight_layout()
    out = Path(workdir) / CURVES_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
