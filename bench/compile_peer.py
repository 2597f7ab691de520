"""python -m bench.compile_peer: memory per chip of our BERT-base MLM step against transformers' Flax BERT,
compiled by the chip's own compiler for one target, in one run.

    python -m bench.compile_peer --target v5e-8                  # 32 sequences per chip of 512, both remat settings
    python -m bench.compile_peer --target v5e-8 --fit            # and the largest per-chip batch each side fits
    .venv-gpu/bin/python -m bench.compile_peer --target h100-8   # the same with XLA's GPU compiler

The peer is transformers 4.46.3's `FlaxBertForMaskedLM`, the last Flax BERT in transformers, installed apart
from the project's transformers 5 (`--peer-dir`, default .peer/transformers-4.46.3; the command to install it
is printed when it is missing). Its step follows transformers' examples/flax/language-modeling/run_mlm_flax.py:
logits at every position over the full vocabulary, in float32, softmax cross-entropy weighted by the MLM
mask, AdamW; parameters and optimizer state float32 and replicated, compute bfloat16, the batch split over
every chip, XLA's attention, dropout 0.1; remat is its `gradient_checkpointing`.

Ours is `--config` (default configs/bert_base_mlm_l512.yaml) in its own layout and in the other of data parallel
and FSDP: the same shapes (BERT-base, vocabulary 30522, L 512), bfloat16 compute, float32 parameters, splash
attention on a TPU and JAX's Pallas GPU kernel (packed rows) on a GPU, logits only at the chosen positions (the
config's mlm.predictions_per_row slots a row); remat is model.remat=full (and dots). --remat none or on compiles
one half of the table. Both steps are compiled for the same target (train/aot/targets.py) and reported per chip:
arguments, temporaries, the compiler's peak, whether it fits; with --fit, the largest per-chip batch that fits for
each (train/aot/fit.py's search, one compile per probe). The table goes to stdout and, with --record, to
bench/records/.
Exit codes: 0 done, 2 bad usage or the peer not installed (one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from bench.record_files import write_record

ROOT = Path(__file__).resolve().parents[1]
PEER_DIR = ROOT / ".peer" / "transformers-4.46.3"
PEER_INSTALL = ('pip install --target {dir} --no-deps transformers==4.46.3 "tokenizers<0.21" regex '
                '"huggingface_hub<1.0" safetensors packaging filelock requests urllib3 idna charset-normalizer '
                'certifi pyyaml tqdm')
BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, max_position_embeddings=512)
GiB = 2**30


@dataclasses.dataclass
class Row:
    side: str  # "peer" or "ours (<layout>)"
    remat: str
    per_chip: int
    compiled: bool
    arguments: int
    temporaries: int
    peak: int
    fits: bool
    seconds: float
    largest: int | None = None  # --fit: the largest per-chip batch that fits


def _peer_import(peer_dir: Path) -> Any:
    if not (peer_dir / "transformers" / "__init__.py").is_file():
        raise SystemExit(f"python -m bench.compile_peer: the peer is not installed in {peer_dir}: "
                         f"{PEER_INSTALL.format(dir=peer_dir)}")
    sys.path.insert(0, str(peer_dir))
    import transformers

    if transformers.__version__ != "4.46.3":
        raise SystemExit(f"python -m bench.compile_peer: {peer_dir} holds transformers {transformers.__version__}, not "
                         f"4.46.3: {PEER_INSTALL.format(dir=peer_dir)}")
    return transformers


def peer_step(transformers: Any, devices: list[Any], global_batch: int, length: int, remat: bool) -> Any:
    """The peer's train step lowered for `devices` (data parallel: state replicated, batch split)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import traverse_util
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    config = transformers.BertConfig(**BERT_BASE)
    model = transformers.FlaxBertForMaskedLM(config, dtype=jnp.bfloat16, _do_init=False,
                                             gradient_checkpointing=remat)

    def decay(params: Any) -> Any:  # run_mlm_flax.py: no weight decay on biases and LayerNorm scales
        flat = traverse_util.flatten_dict(params)
        return traverse_util.unflatten_dict({p: p[-1] != "bias" and p[-2:] != ("LayerNorm", "scale") for p in flat})

    tx = optax.adamw(1e-4, weight_decay=0.01, mask=decay)

    def step(state: Any, batch: Any) -> Any:
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)

        def loss_fn(p: Any) -> Any:
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], params=p,
                           dropout_rng=dropout_key, train=True)[0]
            xent = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
            return jnp.sum(xent * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    mesh = Mesh(np.asarray(devices), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.eval_shape(lambda k: model.init_weights(k, (1, 1)), jax.random.key(0))
    state = (params, jax.eval_shape(tx.init, params), jax.eval_shape(lambda: jax.random.key(0)))
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), state)
    batch = {name: jax.ShapeDtypeStruct((global_batch, length), dtype, sharding=split) for name, dtype in
             (("input_ids", jnp.int32), ("attention_mask", jnp.int32), ("labels", jnp.int32),
              ("weights", jnp.float32))}
    shardings = jax.tree.map(lambda s: s.sharding, state)
    return jax.jit(step, donate_argnums=0, out_shardings=(shardings, replicated)).lower(state, batch)


def peer_row(transformers: Any, devices: list[Any], target: Any, per_chip: int, length: int, remat: bool) -> Row:
    from train.aot import targets
    from train.aot.compiled import _memory

    start = time.perf_counter()
    lowered = peer_step(transformers, devices, per_chip * len(devices), length, remat)
    try:
        executable = lowered.compile()
    except Exception as err:
        oom = targets.parse_oom(str(err))
        if oom is None:
            raise
        return Row("peer", "on" if remat else "none", per_chip, False, 0, 0, int(oom[0]), False,
                   time.perf_counter() - start)
    m = _memory(executable)
    usable = targets.usable_bytes(target, devices[0])
    fits = target.platform == "tpu" or m["total"] <= usable
    return Row("peer", "on" if remat else "none", per_chip, True, m["arguments"], m["temporaries"], m["total"], fits,
               time.perf_counter() - start)


def ours_row(config: str, overrides: list[str], devices: list[Any], target: Any, layout: str | None, per_chip: int,
             remat: str) -> Row:
    from train.aot import shapes
    from train.aot.compiled import compile_run

    resolved = shapes.resolve(config, [*overrides, f"model.remat={remat}"], len(devices), layout,
                              fixed_devices=True)
    data_parallel = resolved.mesh["data"] * resolved.mesh["fsdp"]
    train = resolved.config.train.model_copy(update={"batch_size": per_chip * data_parallel})
    resolved = dataclasses.replace(resolved, config=resolved.config.model_copy(update={"train": train}))
    result = compile_run(resolved, devices[: resolved.devices], target, config, calls=("train",))
    call = result.calls[0]
    m = call.memory
    return Row(f"ours ({resolved.mesh_text()})", remat, per_chip, call.compiled, m.get("arguments", 0),
               m.get("temporaries", 0), m.get("total", 0), call.fits(result.usable, target.platform), call.seconds)


def largest(probe: Any, first: Row, usable: int) -> int:
    """The largest per-chip batch that fits (train/aot/fit.py's search), starting from the row already
    compiled; `probe(n)` compiles the row at n per chip."""
    from train.aot.fit import Probe, _largest

    rows = {first.per_chip: first}

    def one(n: int) -> Probe:
        row = rows[n] if n in rows else rows.setdefault(n, probe(n))
        return Probe(n, row.fits, row.peak or None, None, row.seconds)

    return _largest(one, first.per_chip, lambda: usable)


def render(rows: list[Row], target: str, chip: str, usable: int, length: int) -> str:
    lines = [f"BERT-base MLM train step, L {length}, compiled for {target} ({chip}, {usable / GiB:.2f} GiB usable "
             "per chip): memory per chip from the compiler", "",
             "| step | remat | per chip | arguments GiB | temporaries GiB | peak GiB | fits | largest per-chip batch | "
             "compile s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.side} | {r.remat} | {r.per_chip} | {r.arguments / GiB:.2f} | {r.temporaries / GiB:.2f} | "
                     f"{r.peak / GiB:.2f} | {'yes' if r.fits else '**no**'} | "
                     f"{'-' if r.largest is None else r.largest} | {r.seconds:.0f} |")
    peer = {r.remat: r for r in rows if r.side == "peer"}
    ours = [r for r in rows if r.side != "peer"]
    for r in ours:
        base = peer.get("none" if r.remat == "none" else "on")  # the same policy on both sides, or no ratio
        if base is not None and r.temporaries and base.temporaries:
            # three decimals: a ratio beside a goal such as 0.5x must not round onto it
            lines.append(f"- {r.side}, remat {r.remat}: {r.temporaries / base.temporaries:.3f}x the peer's "
                         f"temporaries (remat {base.remat})"
                         + (f"; {r.largest / base.largest:.3f}x its largest batch" if r.largest and base.largest
                            else ""))
    return "\n".join(lines)


def count(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a count: give 1 or more")
    return n


def length(text: str) -> int:
    n, most = count(text), BERT_BASE["max_position_embeddings"]
    if n > most:
        raise argparse.ArgumentTypeError(f"{n} is past BERT-base's {most} positions: give 1 to {most}")
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile_peer", description=__doc__.split("\n")[0])
    p.add_argument("--target", default="v5e-8", help="a TPU slice or GPU node set (default v5e-8)")
    p.add_argument("--config", default=str(ROOT / "configs" / "bert_base_mlm_l512.yaml"), help="our BERT-base config")
    p.add_argument("--per-chip", type=count, default=32, help="sequences per chip (default 32)")
    p.add_argument("--length", type=length, default=512,
                   help=f"sequence length, 1 to BERT-base's {BERT_BASE['max_position_embeddings']} (default 512)")
    p.add_argument(
        "--fit", action="store_true", help="also the largest per-chip batch that fits (slow: one compile a probe)",
    )
    p.add_argument("--no-dots", action="store_true",
                   help="with remat, ours with model.remat=full only (default: also dots)")
    p.add_argument("--remat", choices=("none", "on", "both"), default="both",
                   help="the rows without rematerialization, with it, or both (default both)")
    p.add_argument("--own-layout-only", action="store_true",
                   help="ours in the config's layout only (default: also in the other of data parallel and FSDP)")
    p.add_argument("--peer-dir", type=Path, default=PEER_DIR, help=f"where transformers 4.46.3 is (default {PEER_DIR})")
    p.add_argument(
        "--record", action="store_true", help="write the table to bench/records/compile-peer-<target>-<date>.md"
    )
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    from train.aot import targets
    from train.errors import ONE_LINE_ERRORS

    try:
        target = targets.parse(args.target)
        targets.check_compiler(target)
        transformers = _peer_import(args.peer_dir)
        devices = targets.devices(target)
    except ONE_LINE_ERRORS as err:
        print(f"python -m bench.compile_peer: {err}", file=sys.stderr)
        return 2
    except SystemExit as err:
        print(err, file=sys.stderr)
        return 2
    overrides = [f"model.max_len={args.length}", f"data.max_len={args.length}", f"data.buckets=[{args.length}]"]
    from train.aot import shapes

    try:
        own = shapes.resolve(args.config, overrides, len(devices), None, fixed_devices=True).mesh
    except ONE_LINE_ERRORS as err:
        print(f"python -m bench.compile_peer: {err}", file=sys.stderr)
        return 2
    # ours in the config's own layout, and in the other of data parallel and FSDP
    layouts = (None, "dp" if own.get("fsdp", 1) > 1 or own.get("tensor", 1) > 1 else "fsdp")
    layouts = layouts[:1] if args.own_layout_only else layouts
    rows = []
    usable = targets.usable_bytes(target, devices[0])
    ours_policies = ("full",) if args.no_dots else ("full", "dots")
    sides = {"none": ((False, ("none",)),), "on": ((True, ours_policies),)}
    for remat, ours_remat in sides.get(args.remat, sides["none"] + sides["on"]):
        rows.append(peer_row(transformers, devices, target, args.per_chip, args.length, remat))
        if args.fit:
            rows[-1].largest = largest(lambda n, r=remat: peer_row(transformers, devices, target, n, args.length, r),
                                       rows[-1], usable)
        print(rows[-1], file=sys.stderr, flush=True)
        for layout in layouts:
            for policy in ours_remat:
                row = ours_row(args.config, overrides, devices, target, layout, args.per_chip, policy)
                if args.fit:
                    row.largest = largest(lambda n, lay=layout, pol=policy: ours_row(
                        args.config, overrides, devices, target, lay, n, pol), row, usable)
                rows.append(row)
                print(rows[-1], file=sys.stderr, flush=True)
    text = render(rows, target.name, devices[0].device_kind, usable, args.length)
    print(text)
    if args.record:
        write_record(f"compile-peer-{target.name}", "Memory per chip against transformers' Flax BERT",
                     "python -m bench.compile_peer", argv, text)
    return 0


if __name__ == "__main__":
    from train import platforms

    platforms.choose("compile")
    platforms.start_jax()  # the CUDA plugin's expected start-up lines on a host without a GPU held back
    sys.exit(main())
