"""Where a fine-tuning step of the pretrained main job goes, and what the data-side options give.

    python -m bench.finetune_data [--config configs/sentiment_pretrained.yaml] [--repeats 4]

Times the trainer's own compiled train step (its runner, state and optimizer) on the checkpoint of the
config at each bucket length L of data.buckets, with the token table trained (dense gradient and AdamW
update of the 30522 x 384 embedding) and frozen (optim.freeze=[embedding]). The step times are measured
interleaved (one round of every shape, repeated), so the load of a shared machine falls on all alike.
Then one epoch's batches under each batching are priced with those times: random batches on the coarse
buckets [16, 32, 64] (the sentiment.yaml default) against length-sorted windows on data.buckets. Prints
the real tokens/s of each combination and its ratio to the first: ratios, not absolute speeds, are what
carry over between machines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from train.errors import ConfigError, DataError

COARSE = [16, 32, 64]


def _plan(config_path: str, overrides: list[str]) -> Any:
    from train import run
    from train.config import load_config

    config = load_config(config_path, ["train.progress=false", *overrides])
    return run.plan_run(config, Path(tempfile.mkdtemp(prefix="bench-finetune-")) / "w")


def step_times(plan: Any, lengths: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one train step at [batch, L] for each L (compiled first, then `repeats`
    interleaved rounds over the lengths), on real training rows cut or padded to L."""
    state = plan.initial_state()
    base = plan.batches.example_batch(0)
    batch_size = base["tokens"].shape[0]
    rows = {}
    for length in lengths:
        tokens = np.full((batch_size, length), plan.dataset.train.pad_id, np.int32)
        valid = np.zeros((batch_size, length), bool)
        for i, ids in enumerate(plan.dataset.train.tokens[:batch_size]):
            n = min(len(ids), length)
            tokens[i, :n], valid[i, :n] = ids[:n], True
        rows[length] = {"tokens": tokens, "valid_tokens": valid, "labels": base["labels"]}
    rng = jax.random.key(0)
    for length in lengths:  # compile every shape
        state, metrics = plan.runner.train_step(state, rows[length], rng)
        jax.block_until_ready(metrics)
    times: dict[int, list[float]] = {length: [] for length in lengths}
    for _ in range(repeats):
        for length in lengths:
            start = time.perf_counter()
            state, metrics = plan.runner.train_step(state, rows[length], rng)
            jax.block_until_ready(metrics)
            times[length].append(time.perf_counter() - start)
    return {length: statistics.median(ts) for length, ts in times.items()}


def epoch_lengths(plan: Any, buckets: list[int], sort_window: int) -> tuple[list[int], int]:
    """(padded length of each batch of one epoch, real tokens in it) under a batching."""
    from train.data.labelled import train_batch

    split = plan.dataset.train
    batch_size = plan.config.train.batch_size
    steps = len(split) // batch_size
    lengths, real = [], 0
    for step in range(steps):
        b = train_batch(split, seed=0, step=step, batch_size=batch_size, buckets=buckets, sort_window=sort_window)
        lengths.append(b["tokens"].shape[1])
        real += int(b["valid_tokens"].sum())
    return lengths, real


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.finetune_data", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/sentiment_pretrained.yaml")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", help="time only these L (the other bucket lengths are "
                        "interpolated linearly between them): fewer compiles on a slow machine")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(n < 1 for n in args.lengths or []):
        parser.error("--repeats and --lengths take positive counts")
    try:
        trained = _plan(args.config, ["optim.freeze=[]", *args.overrides])
        frozen = _plan(args.config, ["optim.freeze=[embedding]", *args.overrides])
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    fine = list(trained.config.data.buckets)
    lengths = sorted(set(fine) | set(COARSE))
    timed = sorted(args.lengths) if args.lengths else lengths
    measured = {"trained": step_times(trained, timed, args.repeats), "frozen": step_times(frozen, timed, args.repeats)}
    times = {name: {n: float(np.interp(n, timed, [t[m] for m in timed])) for n in lengths}
             for name, t in measured.items()}
    if timed != lengths:
        print(f"timed L = {timed}; the others interpolated linearly")
    print(f"step seconds at batch {trained.config.train.batch_size} x L (median of {args.repeats}, interleaved):")
    print("  L      " + "  ".join(f"{n:>6}" for n in lengths))
    for name, t in times.items():
        print(f"  {name:7}" + "  ".join(f"{t[n]:6.3f}" for n in lengths))
    share = [(times["trained"][n] - times["frozen"][n]) / times["trained"][n] for n in lengths]
    print("  the embedding's gradient + update: " + ", ".join(f"L={n} {s:.0%}" for n, s in zip(lengths, share,
                                                                                               strict=True)))
    window = trained.config.data.sort_window or 64
    batchings = {"random, buckets [16, 32, 64]": epoch_lengths(trained, COARSE, 0),
                 f"sorted windows of {window}, buckets {fine}": epoch_lengths(trained, fine, window)}
    first = None
    print("one epoch (real tokens/s, priced with the step times above):")
    for bname, (pads, real) in batchings.items():
        for tname, t in times.items():
            seconds = sum(t[n] for n in pads)
            rate = real / seconds
            first = first or rate
            fill = real / (sum(pads) * trained.config.train.batch_size)
            print(f"  {bname:42} embedding {tname:7}: {rate:7.0f} tokens/s  x{rate / first:4.2f}  "
                  f"({seconds:5.0f} s an epoch, {fill:.0%} of padded tokens real)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
