"""python -m bench.mlm_slots: how many tokens the masking chooses a row on a config's data, and what each
number of prediction slots P (mlm.predictions_per_row) would cap.

    python -m bench.mlm_slots --config configs/bert_base_mlm_l512.yaml               # 60 batches
    python -m bench.mlm_slots --config configs/bert_base_mlm_l512.yaml --batches 8 --record

The masked-LM head predicts at P slots a row, and its float32 logits [N, P, V] are among a step's largest
buffers; the masking never chooses more than P tokens a row (train/data/masking.py), so a P below what rows
choose drops predictions. This reads the config's training stream (tokenizer, packing, whole-word masking:
the run's own pipeline) with the cap lifted and prints the chosen count's distribution and, for each
candidate P, the share of rows over it and of chosen tokens it would drop. The table goes to stdout and, with
--record, to bench/records/mlm-slots-<config>-<date>.md.
Exit codes: 0 done, 2 bad usage or a bad config (one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.record_files import write_record


def chosen_counts(config: Any, batches: int) -> dict[str, np.ndarray]:
    """Per training row of the first `batches` batches: chosen tokens (no cap), real tokens, examples."""
    from train.data.batches import StreamBatches
    from train.data.pretrain import load_corpus

    corpus = load_corpus(config, tokenizer_dir=None)
    corpus = dataclasses.replace(corpus, masking=dataclasses.replace(corpus.masking, max_per_row=None))
    source = StreamBatches(corpus, config)
    chosen, real, examples = [], [], []
    try:
        for step in range(batches):
            b = source.batch(step)
            chosen.append((b["mlm_weights"] > 0).sum(axis=1))
            real.append(b["valid_tokens"].sum(axis=1))
            seg = b.get("segment_ids")
            examples.append(np.ones(len(b["tokens"]), int) if seg is None else
                            np.array([np.unique(r[r >= 0]).size for r in seg]))
    finally:
        source.close()
    return {"chosen": np.concatenate(chosen), "real": np.concatenate(real), "examples": np.concatenate(examples)}


def candidates(counts: np.ndarray, configured: int) -> list[int]:
    """P values worth a row: around the distribution's middle up to its maximum, the config's and the default."""
    lo, hi = int(np.percentile(counts, 50)), int(counts.max())
    return sorted({*range(lo, hi + 1, max(1, (hi - lo) // 8)), hi, configured})


def render(stats: dict[str, np.ndarray], config_name: str, configured: int, default: int, length: int) -> str:
    c, real, ex = stats["chosen"], stats["real"], stats["examples"]
    lines = [f"{config_name}: {c.size} training rows of {length} tokens; real tokens a row {real.mean():.1f}, "
             f"examples a row {ex.mean():.1f} (at most {ex.max()})",
             f"chosen a row (no cap): mean {c.mean():.2f}, sd {c.std():.2f}, max {c.max()}; "
             f"{c.sum() / real.sum():.4f} of real tokens",
             "percentiles: " + ", ".join(f"{q}%: {np.percentile(c, q):.0f}" for q in (50, 90, 99, 99.9)),
             f"P in use: {configured}" + ("" if configured != default else " (the default, ceil(1.6 rate L) + 2)"),
             "", "| P | rows over P | chosen tokens the cap drops |", "| --- | --- | --- |"]
    for p in candidates(c, configured) + ([default] if default not in candidates(c, configured) else []):
        over = np.maximum(c - p, 0).sum()
        mark = " (in use)" if p == configured else ""
        lines.append(f"| {p}{mark} | {np.mean(c > p):.5f} | {over / c.sum():.6f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mlm_slots", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a task=mlm config")
    p.add_argument("--batches", type=int, default=60, help="training batches to read (default 60)")
    p.add_argument("--record", action="store_true", help="write the table to bench/records/")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.batches < 1:
        print("python -m bench.mlm_slots: --batches must be 1 or more", file=sys.stderr)
        return 2
    from train.config import load_config
    from train.data.masking import prediction_slots
    from train.errors import ONE_LINE_ERRORS

    try:
        config = load_config(args.config, [*args.overrides, "data.prefetch=none"])
        if config.task != "mlm":
            raise ValueError(f"{args.config} is a task={config.task} config: give a task=mlm one")
        stats = chosen_counts(config, args.batches)
    except (*ONE_LINE_ERRORS, ValueError) as err:
        print(f"python -m bench.mlm_slots: {err}", file=sys.stderr)
        return 2
    length, rate = config.data.max_len, config.mlm.rate
    text = render(stats, Path(args.config).name, prediction_slots(rate, length, config.mlm.predictions_per_row),
                  prediction_slots(rate, length), length)
    print(text)
    if args.record:
        write_record(f"mlm-slots-{Path(args.config).stem}", "Chosen tokens a row against the prediction slots",
                     "python -m bench.mlm_slots", argv, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
