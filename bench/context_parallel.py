"""Context parallelism measured on simulated CPU devices: equal to one device, memory per device, longest L.

    python -m bench.context_parallel equality           # strategy x C x mask kind: max |diff| vs one device
    python -m bench.context_parallel memory             # per-device memory, longest L, step time at C = 1..8
    python -m bench.context_parallel memory --quick     # short lengths, C = 1 and 2 (the smoke test)
    python -m bench --only context                      # the memory tables, in a child process like these

Runs with 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here before JAX
starts). Every sharded figure comes from the training code itself: train/devices/runners.py's ShardedRunner
(placement, L padding, the kernel context) and its compiled train step.

equality: a 2-layer classifier (D=32, H=4, L=32, 4 rows) on one device with the unfused attention (plain
softmax, autodiff) against the sharded run with C = 2 (fsdp 2 x tensor 2 beside it), 4 (data 2) and 8, both
strategies, for each mask kind. Columns: max |diff| of the loss, the logits, the encoder output [N, L, D] and
every parameter gradient (the largest over all leaves), float32.

memory: XLA's memory analysis of the compiled train step (one row, AdamW, a 2-layer D=256 encoder) on a mesh
of C devices (context = C, nothing else), per device: temporaries (activations), arguments (parameters,
optimizer state, batch), their peak; then the longest L whose peak fits the budget that one device needs
at the base length; then the step time on C devices against one device at the same L (the same total work,
on the same shared CPU cores: the ratio is the overhead of splitting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

DEVICES = 8
KINDS = ("padded", "packed", "causal", "windowed", "no_key", "gqa", "mqa")
SHARDS = (2, 4, 8)
STRATEGIES = ("all_gather", "ring")
# The other mesh axes beside context on 8 devices (data, fsdp, tensor).
BESIDE = {2: {"data": 1, "fsdp": 2, "tensor": 2}, 4: {"data": 2}, 8: {"data": 1}}
LENGTH, ROWS = 32, 4
SHORT = 64  # memory: per-device tokens of the short step whose temporaries are the part that does not grow with L


def _use_devices() -> None:
    """8 simulated CPU devices, set before JAX starts its backend."""
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# --- equality ---------------------------------------------------------------------------------------


def model_config(kind: str, *, context: int = 1, strategy: str = "all_gather", length: int = LENGTH) -> Any:
    """The config of one equality case: one device with the unfused attention (context=1) or the sharded run."""
    from train.config import config_from_dict

    attention: dict[str, Any] = {"chunk_size": 8}
    block: dict[str, Any] = {"model_dim": 32, "num_heads": 4, "ffn_dim": 64, "attention": attention}
    stack: dict[str, Any] = {}
    if kind == "causal":
        attention["causal"] = True
    if kind == "gqa":
        block["num_kv_heads"] = 2
        attention["causal"] = True
    if kind == "mqa":
        block["num_kv_heads"] = 1
    if kind == "windowed":
        stack["layers"] = {"window": [3, None]}
    if context == 1:
        attention["kernel"] = "unfused"
        parallel: dict[str, Any] = {"strategy": "single"}
    else:
        parallel = {"strategy": "sharded", "mesh": {**BESIDE[context], "context": context},
                    "context_strategy": strategy}
    return config_from_dict({
        "model": {"vocab_size": 32, "num_classes": 3, "max_len": length, "num_layers": 2, "block": block, **stack},
        "train": {"batch_size": ROWS}, "parallel": parallel,
    })


def make_batch(kind: str, length: int = LENGTH, rows: int = ROWS, seed: int = 0) -> dict[str, Any]:
    """Padded rows of random lengths; packed rows (segment ids, -1 on padding, labels per segment slot);
    no_key: packed rows plus rows without any token, so whole rows and padded tokens see no key."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 4, length + 1, rows)
    lengths[0] = length
    if kind == "no_key":
        lengths[1] = 0
    valid = np.arange(length)[None, :] < lengths[:, None]
    tokens = np.where(valid, rng.integers(1, 32, (rows, length)), 0).astype(np.int32)
    batch = {"tokens": tokens, "valid_tokens": valid}
    if kind in ("packed", "no_key"):
        segments = 3
        seg = np.full((rows, length), -1, np.int32)
        for i, n in enumerate(lengths):
            cuts = np.sort(rng.choice(np.arange(1, max(n, 2)), min(segments - 1, max(n - 1, 0)), replace=False))
            seg[i, :n] = np.searchsorted(cuts, np.arange(n), side="right")
        labels = np.where(np.arange(segments)[None, :] <= seg.max(axis=1, keepdims=True),
                          rng.integers(0, 3, (rows, segments)), -1).astype(np.int32)
        return batch | {"segment_ids": seg, "labels": labels}
    labels = rng.integers(0, 3, rows).astype(np.int32)
    labels[lengths == 0] = -1
    return batch | {"labels": labels}


def _evaluate(config: Any, params: Any, batch: Any, runner: Any = None) -> dict[str, Any]:
    """Loss, logits, encoder output and parameter gradients of `batch`, on one device or under `runner`."""
    import contextlib

    import jax

    from jaxblock import Encoder
    from train.tasks import CLASSIFICATION

    task = CLASSIFICATION
    model = task.build_model(config.model)

    def f(p: Any, b: Any) -> dict[str, Any]:
        with runner.kernel_context() if runner is not None else contextlib.nullcontext():
            def loss_fn(q: Any) -> Any:
                out = task.apply(model.apply, q, b, train=False, rng=None)
                return task.loss(out, b), out

            (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
            hidden = Encoder(config.model).apply({"params": p["encoder"]}, b["tokens"], b["valid_tokens"],
                                                 segment_ids=b.get("segment_ids"))
        return {"loss": loss, "logits": logits, "hidden": hidden, "grads": grads}

    if runner is None:
        return jax.device_get(jax.jit(f)(params, batch))
    placed = jax.device_put(params, runner.state_sharding.params)
    step = jax.jit(f)
    on_mesh = runner.place_batch(batch)
    text = step.lower(placed, on_mesh).as_text()
    out = jax.device_get(step(placed, on_mesh))
    out["collective"] = "collective_permute" in text if runner.context_strategy == "ring" else "all_gather" in text
    return out


def equality_rows(kinds: tuple[str, ...] = KINDS, shards: tuple[int, ...] = SHARDS,
                  strategies: tuple[str, ...] = STRATEGIES) -> list[dict[str, Any]]:
    """One row per (kind, C, strategy): max |diff| of loss, logits, encoder output, gradients vs one device."""
    import jax
    import numpy as np

    from jaxblock import Classifier
    from train.devices.runners import ShardedRunner
    from train.loop.state import abstract_init, create_state, init_params
    from train.tasks import CLASSIFICATION

    rows = []
    for kind in kinds:
        ref_config = model_config(kind)
        params = jax.device_get(jax.jit(lambda c=ref_config: init_params(Classifier(c.model), 0, LENGTH))())
        batch = make_batch(kind)
        ref = _evaluate(ref_config, params, batch)
        for context in shards:
            for strategy in strategies:
                config = model_config(kind, context=context, strategy=strategy)
                state = create_state(Classifier(config.model), params, config.optim, 1)
                specs = abstract_init(Classifier(config.model), LENGTH)[1]
                runner = ShardedRunner(config, state, CLASSIFICATION, specs)
                got = _evaluate(config, params, batch, runner)
                diff = {k: float(np.max(np.abs(np.asarray(got[k]) - np.asarray(ref[k]))))
                        for k in ("loss", "logits", "hidden")}
                diff["grads"] = max(float(np.max(np.abs(a - b))) for a, b in
                                    zip(jax.tree.leaves(got["grads"]), jax.tree.leaves(ref["grads"]), strict=True))
                mesh = dict(runner.mesh.shape)
                rows.append({"kind": kind, "context": context, "strategy": strategy,
                             "mesh": "x".join(f"{a}{n}" for a, n in mesh.items() if n > 1),
                             "kernel_collective": got["collective"], **diff,
                             "grad_scale": max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref["grads"]))})
    return rows


def format_equality(rows: list[dict[str, Any]]) -> str:
    out = ["| mask kind | C | strategy | mesh | loss | logits | encoder output | gradients (max over leaves) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['kind']} | {r['context']} | {r['strategy']} | {r['mesh']} | {r['loss']:.1e} | "
                   f"{r['logits']:.1e} | {r['hidden']:.1e} | {r['grads']:.1e} |")
    return "\n".join(out)


# --- memory, longest L, step time ----------------------------------------------------------------------


def memory_config(length: int, context: int, strategy: str) -> Any:
    from train.config import config_from_dict

    return config_from_dict({
        "model": {"vocab_size": 256, "num_classes": 2, "max_len": length, "num_layers": 2,
                  "embedding": {"positions": "none"},
                  "block": {"model_dim": 256, "num_heads": 4, "ffn_dim": 1024,
                            "attention": {"rope": True, "chunk_size": 256}}},
        "data": {"buckets": [length], "max_len": length},
        "optim": {"optimizer": "adamw", "warmup_steps": 0, "schedule": "constant"},
        "train": {"batch_size": 1},
        "parallel": {"strategy": "sharded", "mesh": {"data": 1, "context": context}, "context_strategy": strategy},
    })


def _runner(length: int, context: int, strategy: str) -> tuple[Any, Any, Any]:
    """(runner on the first `context` devices, host state, a batch of one full row of `length` tokens)."""
    import jax
    import numpy as np

    from jaxblock import Classifier
    from train.devices.runners import ShardedRunner
    from train.loop.state import abstract_init, create_state
    from train.tasks import CLASSIFICATION

    config = memory_config(length, context, strategy)
    model = Classifier(config.model)
    shapes, specs = abstract_init(model, length)
    state = jax.eval_shape(lambda: create_state(model, jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes),
                                                config.optim, 10))
    runner = ShardedRunner(config, state, CLASSIFICATION, specs, devices=jax.devices()[:context])
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(1, 256, (1, length)).astype(np.int32), "valid_tokens": np.ones((1, length), bool),
             "labels": np.zeros((1,), np.int32)}
    return runner, state, batch


def step_memory(length: int, context: int, strategy: str) -> dict[str, int]:
    """XLA's per-device memory plan of the compiled train step (nothing runs)."""
    import jax

    from bench.measure import compiled_memory

    runner, state, batch = _runner(length, context, strategy)
    abstract = runner.abstract_state(state)
    placed = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=runner.token_sharding if v.ndim == 2
                                      else runner.batch_sharding) for k, v in batch.items()}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=runner.replicated)
    return compiled_memory(runner._train.lower(abstract, placed, key).compile())


def longest_length(budget: int, context: int, strategy: str, known: dict[int, int], step: int) -> int:
    """The longest L (a multiple of `step`) whose compiled step's peak per device fits `budget` bytes. The peak
    grows linearly in L (`known`: peak bytes at two lengths): predicted from the line, then checked by
    compiling there and one step further, moving a step at a time until the two disagree."""
    (l0, p0), (l1, p1) = sorted(known.items())[:2]
    slope = (p1 - p0) / (l1 - l0)
    guess = max(step, int((l0 + (budget - p0) / slope) // step * step))

    def fits(length: int) -> bool:
        return step_memory(length, context, strategy)["xla_peak_bytes"] <= budget

    if fits(guess):
        while fits(guess + step):
            guess += step
        return guess
    while guess > step and not fits(guess - step):
        guess -= step
    return guess - step


def step_times(length: int, shards: tuple[int, ...], strategy: str, reps: int, warmup: int) -> dict[int, list[float]]:
    """Seconds per train step (one row of `length`) on meshes of C devices, interleaved."""
    import jax

    from bench.measure import time_interleaved

    fns: dict[str, Any] = {}
    for context in shards:
        runner, state, batch = _runner(length, context, strategy)
        host = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), state)
        held = {"state": runner.place_state(host)}
        placed = runner.place_batch(batch)
        key = runner._place_key(jax.random.key(0))

        def call(runner: Any = runner, held: dict[str, Any] = held, placed: Any = placed, key: Any = key) -> None:
            held["state"], metrics = runner._train(held["state"], placed, key)
            jax.block_until_ready(metrics)

        fns[str(context)] = call
    return {int(c): t for c, t in time_interleaved(fns, reps=reps, warmup=warmup).items()}


def memory_records(quick: bool, reps: int, warmup: int, log: Any = print) -> list[Any]:
    """The memory / longest-L / step-time records (bench.measure.Record) of both strategies."""
    from bench.measure import Record

    base = 512 if quick else 4096
    shards = (1, 2) if quick else (1, 2, 4, 8)
    records = []
    for strategy in STRATEGIES:
        at_base = {c: step_memory(base, c, strategy) for c in shards}
        # What does not grow with L (gradient and optimizer temporaries): the temporaries at a short L.
        short = {c: step_memory(SHORT * c, c, strategy) for c in shards}
        fixed = {c: short[c]["xla_temp_bytes"] for c in shards}
        budget = at_base[1]["xla_peak_bytes"]
        for c in shards:
            mem = at_base[c] | {"activation_bytes": at_base[c]["xla_temp_bytes"] - fixed[c]}
            known = {base: mem["xla_peak_bytes"], SHORT * c: short[c]["xla_peak_bytes"]}
            # C = 1: the budget is its own peak at the base length
            longest = base if c == 1 else longest_length(budget, c, strategy, known, 256 * c)
            log(f"context {strategy} C={c}: L={base} peak {mem['xla_peak_bytes'] / 2**20:.1f} MiB "
                f"(temp {mem['xla_temp_bytes'] / 2**20:.1f}); longest L in {budget / 2**20:.1f} MiB: {longest}")
            records.append(Record("context", f"memory {strategy} C={c}", {"length": base, "context": c,
                                                                           "strategy": strategy},
                                  0.0, 0.0, 0.0, 0, metrics={**mem, "longest_length": longest,
                                                             "budget_bytes": budget,
                                                             "activations_vs_one_device": round(
                                                                 mem["activation_bytes"] / (at_base[1]["xla_temp_bytes"]
                                                                                            - fixed[1]), 3)}))
        timing_length = 256 if quick else 2048
        # Two untimed steps: the first step's output state is the second's input, whose layout may differ.
        times = step_times(timing_length, shards, strategy, reps, max(warmup, 2))
        timed = {c: Record.from_times("context", f"train step {strategy} C={c}",
                                      {"length": timing_length, "context": c, "strategy": strategy}, times[c])
                 for c in shards}
        for c, rec in timed.items():
            rec.metrics["ratio"] = round(rec.median / timed[1].median, 3)
            log(f"context {strategy} C={c}: step at L={timing_length} {rec.median * 1e3:.1f} ms, "
                f"{rec.metrics['ratio']:.2f}x one device")
            records.append(rec)
    if not quick:
        records += ring_backward_records(2048, 4, reps, max(warmup, 2), log)
    return records


def _autodiff_ring(qg: Any, kl: Any, vl: Any, m: Any, st: Any) -> Any:
    """The ring's forward left to JAX's autodiff (ppermute transposes to the reverse hop): what the
    hand-written backward is measured against."""
    from jaxblock.attention import context

    return context._ring_fwd(qg, kl, vl, m, st)[0]


def ring_backward_records(length: int, context_size: int, reps: int, warmup: int, log: Any = print) -> list[Any]:
    """The ring's hand-written backward against autodiff of its forward: per-device temporaries of the train
    step and its time, at one length on C devices (interleaved)."""
    from unittest import mock

    import jax

    from bench.measure import Record, time_interleaved
    from jaxblock.attention import context

    variants = {"hand-written": context._ring, "autodiff": _autodiff_ring}
    memory: dict[str, Any] = {}
    fns: dict[str, Any] = {}
    for name, ring in variants.items():
        with mock.patch.object(context, "_ring", ring):  # traced (compiled) inside the patch
            memory[name] = step_memory(length, context_size, "ring")
            runner, state, batch = _runner(length, context_size, "ring")
            held = {"state": runner.place_state(jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), state))}
            placed, key = runner.place_batch(batch), runner._place_key(jax.random.key(0))
            held["state"], metrics = runner._train(held["state"], placed, key)  # compiled under the patch
            jax.block_until_ready(metrics)

        def call(runner: Any = runner, held: dict[str, Any] = held, placed: Any = placed, key: Any = key) -> None:
            held["state"], metrics = runner._train(held["state"], placed, key)
            jax.block_until_ready(metrics)

        fns[name] = call
    times = time_interleaved(fns, reps=reps, warmup=warmup)
    records = []
    for name in variants:
        rec = Record.from_times("context", f"ring backward {name} C={context_size}",
                                {"length": length, "context": context_size, "strategy": "ring"}, times[name],
                                **memory[name])
        records.append(rec)
    hand, auto = records
    auto.metrics["ratio"] = round(auto.median / hand.median, 3)
    auto.metrics["temp_vs_hand_written"] = round(auto.metrics["xla_temp_bytes"] / hand.metrics["xla_temp_bytes"], 3)
    log(f"ring backward at L={length}, C={context_size}: autodiff {auto.metrics['ratio']:.2f}x the hand-written "
        f"step time, {auto.metrics['temp_vs_hand_written']:.2f}x its temporaries")
    return records


def format_memory(records: list[Any]) -> str:
    out = ["| strategy | C | temporaries MiB | of which grow with L | vs C=1 | arguments MiB | peak MiB | "
           "longest L in C=1's peak | step time vs C=1 |", "|---|---|---|---|---|---|---|---|---|"]
    mem = {(r.config["strategy"], r.config["context"]): r for r in records if r.name.startswith("memory")}
    ring = [r for r in records if r.name.startswith("ring backward")]
    step = {(r.config["strategy"], r.config["context"]): r for r in records if r.name.startswith("train step")}
    for (strategy, c), r in mem.items():
        m = r.metrics
        t = step.get((strategy, c))
        out.append(f"| {strategy} | {c} | {m['xla_temp_bytes'] / 2**20:.1f} | {m['activation_bytes'] / 2**20:.1f} | "
                   f"{m['activations_vs_one_device']:.2f} | "
                   f"{m['xla_argument_bytes'] / 2**20:.1f} | {m['xla_peak_bytes'] / 2**20:.1f} | "
                   f"{m['longest_length'] or '-'} | {t.metrics['ratio'] if t else '-'} |")
    if ring:
        out += ["", "| ring backward | L | C | temporaries MiB | step time |", "|---|---|---|---|---|"]
        out += [f"| {r.name.split()[2]} | {r.config['length']} | {r.config['context']} | "
                f"{r.metrics['xla_temp_bytes'] / 2**20:.1f} | {r.median * 1e3:.0f} ms |" for r in ring]
    return "\n".join(out)


# --- the command -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.context_parallel", description=__doc__.split("\n")[0])
    p.add_argument("table", choices=("equality", "memory"), help="which table")
    p.add_argument("--quick", action="store_true", help="memory: short lengths, C = 1 and 2 only")
    p.add_argument("--reps", type=int, default=None, help="timed steps per mesh (default 5; quick 2)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows/records as JSON here")
    try:
        args = p.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.reps is not None and args.reps < 1:
        print(f"python -m bench.context_parallel: --reps {args.reps} is too small: pass a positive count",
              file=sys.stderr)
        return 2
    _use_devices()
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    if jax.device_count() < DEVICES:
        print(f"python -m bench.context_parallel: {jax.device_count()} devices, {DEVICES} needed: run it on CPU "
              "(JAX_PLATFORMS=cpu) so that the simulated devices apply", file=sys.stderr)
        return 2
    started = time.time()
    if args.table == "equality":
        rows = equality_rows()
        print(format_equality(rows))
        payload: Any = rows
    else:
        from dataclasses import asdict

        records = memory_records(args.quick, args.reps or (2 if args.quick else 5), 1,
                                 log=lambda m: print(m, file=sys.stderr))
        print(format_memory(records))
        payload = [asdict(r) for r in records]
    print(f"({time.time() - started:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def section(ctx: Any) -> list[Any]:
    """`python -m bench --only context`: the memory table, from `python -m bench.context_parallel memory` in a
    child process (the simulated devices must be set before JAX starts; this process's JAX has started)."""
    import subprocess
    import tempfile

    from bench.measure import Record

    with tempfile.TemporaryDirectory(prefix="context-bench-") as tmp:
        out = Path(tmp) / "context.json"
        command = [sys.executable, "-m", "bench.context_parallel", "memory", "--json", str(out), "--reps",
                   str(ctx.reps), *(["--quick"] if ctx.quick else [])]
        done = subprocess.run(command, cwd=Path(__file__).resolve().parents[1],
                              env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[1:4])} exited {done.returncode}")
        ctx.log(done.stdout.strip())
        return [Record(**r) for r in json.loads(out.read_text())]
