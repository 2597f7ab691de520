"""What each option buys, measured against the default configuration in the same interleaved run.

options  the training step at the first benchmark shape (Pre-LN) with one option changed at a time:
         fused QKV off, attention kernel (XLA's, unfused, chunked; a CPU's default is dense), scan over layers,
         remat (full, dots), bf16 compute (float32 params; float32 softmax and norm statistics), no buffer donation.
         Remat on unrolled layers recomputes but saves no memory on XLA's CPU backend (its scheduler
         runs the recomputation early), so remat is measured with scan too.
         `speedup` = default median / variant median (> 1: the option is faster).
packing  the main job's model and data (configs/sentiment.yaml: Rotten Tomatoes, BPE) for one pass
         over the same examples: padded to length buckets vs packed several to a row with segment_ids.
         Falls back to synthetic short-sentence lengths (and says so) when the data is unavailable.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from bench.context import Context
from bench.measure import Record, compiled_memory, peak_rss, time_interleaved
from bench.workloads import OursTrain, init_params, make_inputs, stack_config

ROOT = Path(__file__).resolve().parent.parent


def options(ctx: Context) -> list[Record]:
    shape = ctx.small
    other_dtype = "float32" if ctx.dtype == "bfloat16" else "bfloat16"
    variants: dict[str, tuple[dict[str, Any], bool]] = {
        "default": ({}, True),
        "fused_qkv off": ({"attention": {"fused_qkv": False}}, True),
        "attention xla": ({"attention": {"kernel": "xla"}}, True),
        "attention unfused": ({"attention": {"kernel": "unfused"}}, True),
        "attention chunked": ({"attention": {"kernel": "chunked", "chunk_size": max(shape.length // 2, 1)}}, True),
        "scan": ({"scan": True}, True),
        "remat full (unrolled)": ({"remat": "full"}, True),
        "scan + remat full": ({"scan": True, "remat": "full"}, True),
        "scan + remat dots": ({"scan": True, "remat": "dots"}, True),
        f"{other_dtype} compute": ({"dtype": other_dtype}, True),
        "no donation": ({}, False),
    }
    x, valid = make_inputs(shape)
    params = init_params(stack_config(shape), shape)
    steps: dict[str, OursTrain] = {}
    configs: dict[str, dict[str, Any]] = {}
    for name, (opts, donate) in variants.items():
        opts = {"dtype": ctx.dtype, **opts}
        scan, remat = opts.pop("scan", False), opts.pop("remat", "none")
        cfg = stack_config(shape, scan=scan, remat=remat, **opts)
        ctx.log(f"options {name}: compiling")
        steps[name] = OursTrain(cfg, params, x, valid, donate=donate)
        configs[name] = {**shape.as_dict(), "scan": scan, "remat": remat, "donate": donate, **opts}
    with peak_rss():
        times = time_interleaved(dict(steps), reps=ctx.reps, warmup=ctx.warmup)
    base = float(np.median(times["default"]))
    records = []
    for name, ts in times.items():
        med = float(np.median(ts))
        records.append(Record.from_times(
            "options", name, configs[name], ts, tokens_per_s=shape.n * shape.length / med, speedup=base / med,
            compile_s=steps[name].compile_s, **compiled_memory(steps[name].compiled),
        ))
    return records


# --- packing ------------------------------------------------------------------------------------


def _sentences(ctx: Context, count: int, max_len: int) -> tuple[list[np.ndarray], np.ndarray, int, str]:
    """(token rows, labels, vocab size, source): the sentiment train split, or synthetic lengths."""
    try:
        from train.config import load_config
        from train.data.labelled import load_dataset

        data = load_config(ROOT / "configs" / "sentiment.yaml").data
        ds = load_dataset(data)
        rows = [np.asarray(t, np.int32) for t in ds.train.tokens[:count]]
        return rows, np.asarray(ds.train.labels[:count], np.int32), ds.tokenizer.vocab_size, data.source
    except Exception as err:  # no download, no cache: measure the same thing on synthetic lengths
        ctx.log(f"packing: sentiment data unavailable ({type(err).__name__}); synthetic lengths instead")
        rng = np.random.default_rng(0)
        # Short-sentence lengths: log-normal around 20 tokens, like BPE-tokenized review snippets.
        lengths = np.clip(np.round(rng.lognormal(np.log(20), 0.5, count)), 2, max_len).astype(int)
        rows = [rng.integers(1, 4000, n).astype(np.int32) for n in lengths]
        return rows, rng.integers(0, 2, count).astype(np.int32), 4000, "synthetic lengths (log-normal, median 20)"


def _classifier_step() -> Any:
    """The trainer's classification loss through its `gradient_step` (padded or packed batches alike)."""
    from train.loop.step import gradient_step, loss_fn_for
    from train.tasks import CLASSIFICATION

    def step(state: Any, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[Any, jax.Array]:
        state, loss, _, _ = gradient_step(state, loss_fn_for(CLASSIFICATION, state, batch, rng))
        return state, loss

    return jax.jit(step, donate_argnums=(0,))


def packing(ctx: Context) -> list[Record]:
    from jaxblock.model import Classifier
    from train.config import Config, load_config
    from train.data.labelled import Split, eval_batches, pack_examples, top_up
    from train.loop.state import init_params as init_classifier_params

    path = ROOT / "configs" / "sentiment.yaml"
    cfg = load_config(path) if path.is_file() else Config()
    model_cfg, buckets, batch = cfg.model, list(cfg.data.buckets), cfg.train.batch_size
    count = 4 * batch if ctx.quick else 32 * batch
    rows, labels, vocab, source = _sentences(ctx, count, model_cfg.max_len)
    rows = [r[: model_cfg.max_len] for r in rows]
    model_cfg = model_cfg.model_copy(update={"vocab_size": max(model_cfg.vocab_size, vocab)})
    model = Classifier(model_cfg)
    params = init_classifier_params(model, seed=0, batch_len=8)
    tx = optax.adamw(1e-3)

    # Padded: consecutive batches of `batch` examples, each padded to its smallest fitting bucket.
    padded = list(eval_batches(Split(rows, labels, []), batch_size=batch, buckets=buckets))
    # Packed: all the examples into rows of max_len, S segments at most, `rows_per` rows a step so a
    # step holds about as many tokens as a padded batch of the largest bucket.
    segments = 8
    packed_all = pack_examples(rows, labels, row_len=model_cfg.max_len, max_segments=segments)
    rows_per = max(batch * buckets[-1] // model_cfg.max_len // 2, 1)
    total_rows = len(packed_all["tokens"])
    steps_needed = math.ceil(total_rows / rows_per)
    packed = []
    for s in range(steps_needed):
        sl = slice(s * rows_per, (s + 1) * rows_per)
        packed.append(top_up({k: packed_all[k][sl] for k in ("tokens", "valid_tokens", "segment_ids", "labels")},
                             rows_per))

    real_tokens = sum(len(r) for r in rows)

    def epoch(step: Any, batches: list[dict[str, np.ndarray]], holder: dict[str, Any]) -> None:
        loss = None
        for i, b in enumerate(batches):
            holder["state"], loss = step(holder["state"], b, jax.random.key(i))
        assert loss is not None
        loss.block_until_ready()

    def fresh_state() -> dict[str, Any]:
        p = jax.tree.map(jnp.array, params)
        return {"state": TrainState.create(apply_fn=model.apply, params=p, tx=tx)}

    pad_state, pack_state = fresh_state(), fresh_state()
    pad_step = pack_step = _classifier_step()
    ctx.log(f"packing: {count} examples from {source}; {len(padded)} padded batches vs {len(packed)} packed")
    with peak_rss():
        times = time_interleaved({"padded (buckets)": lambda: epoch(pad_step, padded, pad_state),
                                  "packed": lambda: epoch(pack_step, packed, pack_state)},
                                 reps=ctx.reps, warmup=max(ctx.warmup, 1))
    computed = {"padded (buckets)": sum(b["tokens"].size for b in padded),
                "packed": sum(b["tokens"].size for b in packed)}
    base = float(np.median(times["padded (buckets)"]))
    config = {"data": source, "examples": count, "batch_size": batch, "buckets": buckets,
              "row_len": model_cfg.max_len, "rows_per_step": rows_per, "max_segments": segments,
              "model_dim": model_cfg.block.model_dim, "num_layers": model_cfg.num_layers}
    records = []
    for name, ts in times.items():
        med = float(np.median(ts))
        records.append(Record.from_times(
            "packing", name, config, ts, examples_per_s=count / med, tokens_per_s=real_tokens / med,
            padding_fraction=1 - real_tokens / computed[name], speedup=base / med, steps=len(
                padded if name.startswith("padded") else packed),
        ))
    return records
