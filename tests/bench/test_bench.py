"""bench: the FLOP formula against a hand count, the timed training step (the trainer's gradient_step),
bad usage, and (slow) the entry point's records in its tiny mode.

Timings are never asserted: only that each measurement is recorded with its fields, that ours and
PyTorch ran on the same weights (their outputs agree), and that bad usage exits 2.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxblock
from bench.__main__ import SECTIONS, main
from bench.flops import executed_train_flops, forward_flops, layer_forward_flops, train_flops
from bench.measure import Record, time_interleaved
from bench.workloads import CLIP, LR, WEIGHT_DECAY, OursTrain, Shape, init_params, make_inputs, stack_config
from jaxblock.attention import choose_implementation
from jaxblock.config import BlockConfig, StackConfig

ROOT = Path(__file__).resolve().parents[2]


def _matmuls(*shapes: tuple[int, int, int]) -> int:
    """Hand count: each (m, k, n) is an [m, k] x [k, n] product of 2·m·k·n FLOPs."""
    return sum(2 * m * k * n for m, k, n in shapes)


def test_layer_flops_match_a_hand_count_of_every_matmul():
    # N=1, L=2, D=4, H=1 (K=4), F=8: 2 tokens through 4 projections, 2 FFN matrices and 1 head.
    block = BlockConfig(model_dim=4, num_heads=1, ffn_dim=8)
    hand = _matmuls(
        (2, 4, 4), (2, 4, 4), (2, 4, 4),  # q, k, v: [tokens, D] x [D, H·K]
        (2, 4, 4),  # out: [tokens, H·K] x [H·K, D]
        (2, 4, 8), (2, 8, 4),  # linear1 [D, F], linear2 [F, D]
        (2, 4, 2), (2, 2, 4),  # head 0: scores q kᵀ [L, K] x [K, L]; weights x v [L, L] x [L, K]
    )
    assert hand == 576
    assert layer_forward_flops(block, n=1, length=2) == hand


def test_flops_with_gqa_glu_and_a_batch():
    # N=2, L=3, D=8, H=4 heads of K=2 sharing G=2 k/v heads; SwiGLU adds the gate matrix.
    block = BlockConfig(model_dim=8, num_heads=4, num_kv_heads=2, ffn_dim=6, activation="swiglu")
    tokens = 2 * 3
    hand = _matmuls(
        (tokens, 8, 8), (tokens, 8, 4), (tokens, 8, 4), (tokens, 8, 8),  # q [D, H·K], k/v [D, G·K], out
        (tokens, 8, 6), (tokens, 8, 6), (tokens, 6, 8),  # linear1, gate, linear2
        *[(3, 2, 3), (3, 3, 2)] * (2 * 4),  # per row and query head: scores and weighted sum
    )
    assert layer_forward_flops(block, n=2, length=3) == hand


def test_the_documented_closed_form_and_training_multiples():
    n, length, d, f, k = 16, 128, 256, 1024, 4
    stack = StackConfig(num_layers=k, block=BlockConfig(model_dim=d, num_heads=4, ffn_dim=f))
    per_layer = 2 * n * length * (4 * d * d + 2 * d * f) + 4 * n * length * length * d
    assert forward_flops(stack, n, length) == k * per_layer
    assert train_flops(stack, n, length) == 3 * k * per_layer  # backward = 2x forward
    assert executed_train_flops(stack, n, length) == train_flops(stack, n, length)
    full = stack.model_copy(update={"remat": "full"})
    assert executed_train_flops(full, n, length) == 4 * k * per_layer  # remat re-runs the forward
    dots = stack.model_copy(update={"remat": "dots"})
    assert executed_train_flops(dots, n, length) == train_flops(dots, n, length)  # matmul outputs saved


FIELDS = {"section", "name", "config", "median", "min", "max", "reps", "unit", "metrics"}


@pytest.mark.slow  # 12 s of compile; the FLOP counts stay in the default suite
def test_timed_training_step_is_one_clipped_adamw_step_on_the_mean_square_loss():
    """OursTrain runs the trainer's gradient_step: loss mean(y^2) of the stack output, clip 1.0, AdamW."""
    shape = Shape(n=2, length=8, d=16, h=2, f=32, k=1)
    cfg = stack_config(shape)
    params = init_params(cfg, shape)
    x, valid = make_inputs(shape, padding=0.25)
    step = OursTrain(cfg, params, x, valid)
    step()

    def loss(p):
        y = jaxblock.EncoderStack(cfg).apply({"params": p}, x, valid, train=True)
        return jax.numpy.mean(jax.numpy.square(y))

    expected_loss, grads = jax.value_and_grad(loss)(params)
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, weight_decay=WEIGHT_DECAY))
    updates, _ = tx.update(grads, tx.init(params), params)
    expected = optax.apply_updates(params, updates)
    assert float(step.loss) == pytest.approx(float(expected_loss), rel=1e-5)
    assert int(step.state.step) == 1
    for got, want, g in zip(jax.tree.leaves(step.state.params), jax.tree.leaves(expected), jax.tree.leaves(grads),
                            strict=True):
        # Adam's first step is about g / (|g| + eps): where |g| is near eps, last-bit differences between
        # this eager gradient and the compiled one are magnified, so compare where the gradient is clear.
        clear = np.abs(np.asarray(g)) > 1e-4
        np.testing.assert_allclose(np.asarray(got)[clear], np.asarray(want)[clear], rtol=1e-5, atol=1e-9)


def test_a_record_holds_the_median_min_max_and_count_of_its_times():
    record = Record.from_times("train", "ours", {}, [0.3, 0.1, 0.5, 0.2], gflop_per_s=2.0)
    assert (record.median, record.min, record.max, record.reps) == (0.25, 0.1, 0.5, 4)
    assert record.metrics["gflop_per_s"] == 2.0


def test_interleaved_timing_calls_each_function_in_turn_and_times_every_repetition():
    calls: list[str] = []
    times = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b") or time.sleep(0.01)},
                             reps=3, warmup=1, pause_s=0.0)
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds, interleaved
    assert [len(times["a"]), len(times["b"])] == [3, 3]
    assert min(times["b"]) >= 0.01  # a call's time includes all of its work (a lower bound, not a speed)


@pytest.mark.slow
def test_quick_run_writes_one_record_per_measurement(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--only", "train,infer", "--reps", "1", "--warmup", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"command", "backend", "threads", "jax", "torch", "loadavg_start"} <= set(data["meta"])
    records = data["records"]
    assert {r["section"] for r in records} == {"peak", "train", "infer"}
    for r in records:
        assert set(r) == FIELDS, r["name"]
        assert r["unit"] == "s" and r["reps"] == 1
        assert r["min"] > 0, r["name"]
    # Both placements, ours and PyTorch, for training and inference.
    names = {(r["section"], r["name"].split(" ")[0], r["config"].get("norm")) for r in records}
    for section in ("train", "infer"):
        for norm in ("pre", "post"):
            assert (section, "ours", norm) in names and (section, "torch", norm) in names
    peak = [r for r in records if r["section"] == "peak" and r["name"].startswith("jax")]
    assert peak and all(r["metrics"]["gflop_per_s"] > 0 for r in peak)
    for r in records:
        if r["name"].startswith("ours"):
            m = r["metrics"]
            assert {"tokens_per_s", "ratio", "impl", "impl_reason"} <= set(m), r["name"]
            # The library's choice for this backend and call, stated with its reason.
            block = BlockConfig(model_dim=r["config"]["D"], num_heads=r["config"]["H"], ffn_dim=r["config"]["F"],
                                norm=r["config"]["norm"], activation="gelu", init="torch")
            impl, reason = choose_implementation(block, train=r["section"] == "train", length=r["config"]["L"])
            assert m["impl_reason"] == reason and m["impl"].startswith(impl.replace("cudnn", "")), r["name"]
            if r["section"] == "train":
                assert {"gflop_per_s", "fraction_of_peak", "flops"} <= set(m)
                assert r["config"]["threads"] >= 1
            else:  # same weights and inputs: the outputs agree at every real token
                assert r["config"]["padding"] == 0.25
                assert m["max_abs_diff_vs_torch"] < 1e-3
    table = capsys.readouterr().out
    assert "ours pre-LN" in table and "torch eager" in table and "torch fast path" in table


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--only", ""], ["--reps", "0"], ["--bogus"]])
def test_bad_usage_exits_2_with_one_line(argv, tmp_path, capsys):
    assert main([*argv, "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err and not (tmp_path / "x.json").exists()
    if argv[0] == "--only":
        assert "\n" not in err and all(s in err for s in SECTIONS)


def test_a_bert_dir_that_is_not_bert_exits_2(tmp_path, capsys):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    for bad in (tmp_path, tmp_path / "llama"):
        assert main(["--only", "bert", "--bert-dir", str(bad), "--json", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--bert-dir" in err and not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_every_section_runs_in_quick_mode(tmp_path):
    out = tmp_path / "all.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert {r["section"] for r in records} == set(SECTIONS)
    for r in records:
        assert set(r) == FIELDS
    options = {r["name"]: r["metrics"] for r in records if r["section"] == "options"}
    assert options["default"]["speedup"] == 1.0 and "scan + remat full" in options and "scan" in options
    packing = {r["name"]: r["metrics"] for r in records if r["section"] == "packing"}
    assert packing["packed"]["padding_fraction"] < packing["padded (buckets)"]["padding_fraction"]
    compile_names = {r["name"] for r in records if r["section"] == "compile"}
    assert {"B=2 scan", "B=2 unrolled"} <= compile_names
    bert = {r["name"].split()[0]: r["metrics"] for r in records if r["section"] == "bert"}
    assert set(bert) == {"ours", "transformers"} and bert["ours"]["ratio"] > 0
    assert bert["ours"]["eval_loss_rel_diff"] < 1e-4  # the same weights and batch on both sides
    assert proc.stdout.startswith("machine: ")  # the table names its CPU and XLA flags
    meta = json.loads(out.read_text())["meta"]
    assert meta["cpu"]


def test_every_table_names_the_machine():
    from bench.measure import Record, format_table
    from bench.report import summarize

    rec = Record.from_times("train", "ours pre-LN N1 L2 D4 B1", {}, [0.1, 0.2], ratio=1.5, fraction_of_peak=0.5)
    assert format_table([rec], machine="AMD EPYC, 2 cores; XLA_FLAGS: none").startswith(
        "machine: AMD EPYC, 2 cores; XLA_FLAGS: none\n")
    meta = {"command": "python -m bench", "processor": "x86_64", "device": "cpu", "threads": 2, "jax": "0.10.2",
            "torch": "2.13", "loadavg_start": [1.0], "reps": 2, "cpu": "AMD EPYC", "xla_flags": "--xla_cpu_a=b"}
    text = summarize({"meta": meta, "records": [{**rec.__dict__, "metrics": rec.metrics}]})
    assert "CPU: AMD EPYC; XLA_FLAGS: `--xla_cpu_a=b`" in text.split("**Training step")[1]


# --- the speed work keeps results exact ----------------------------------------------------------


def test_chunked_attention_gradients_match_autodiff_of_dense_attention_with_every_mask():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxblock.attention import chunked_attention

    rng = np.random.default_rng(0)
    n, length, h, g, k = 3, 7, 4, 2, 4
    q = jnp.asarray(rng.normal(size=(n, length, h, k)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(2, n, length, g, k)), jnp.float32)
    valid = jnp.arange(length)[None, :] < jnp.array([0, 4, 7])[:, None]  # row 0: no real token
    attn_mask = jnp.asarray(rng.random((n, length, length)) < 0.7)
    seg = jnp.array([[0] * 7, [0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 2, 2]], jnp.int32)
    w = jnp.asarray(rng.normal(size=(n, length, h, k)), jnp.float32)

    def dense(q, kk, vv):  # the textbook definition, autodiffed
        r = h // g
        s = jnp.einsum("NQGRK,NMGK->NGRQM", q.reshape(n, length, g, r, k), kk) / np.sqrt(k)
        ok = valid[:, None, :] & attn_mask & (seg[:, :, None] == seg[:, None, :])
        ok = ok & jnp.tril(jnp.ones((length, length), bool))[None]
        ok = ok[:, None, None]  # [N, 1, 1, L, L]
        p = jnp.where(ok, jax.nn.softmax(jnp.where(ok, s, -1e30), axis=-1), 0.0)
        return jnp.einsum("NGRQM,NMGK->NQGRK", p, vv).reshape(n, length, h, k)

    def chunked(q, kk, vv):
        return chunked_attention(q, kk, vv, valid, causal=True, attn_mask=attn_mask, segment_ids=seg, chunk_size=3)

    with jax.default_matmul_precision("highest"):
        outs = [jax.jit(fn)(q, kv[0], kv[1]) for fn in (dense, chunked)]
        assert all(np.all(np.isfinite(np.asarray(o))) for o in outs)
        np.testing.assert_allclose(outs[1], outs[0], atol=1e-5)
        grads = [jax.jit(jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) * w), argnums=(0, 1, 2)))(q, kv[0], kv[1])
                 for fn in (dense, chunked)]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(grads[1][0])[0], 0.0)  # no real key: no gradient


def test_bench_argument_types_refuse_bad_values_with_what_to_pass():
    import argparse

    from bench.arguments import checked, count

    assert count("3") == 3
    for bad in ("0", "-2", "x", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a count: pass a positive integer"):
            count(bad)
    rate = checked(float, lambda v: v > 0, "a learning rate")
    assert rate("5e-5") == 5e-5
    for bad in ("-1", "0", "nan", "abc"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}' is not a learning rate"):
            rate(bad)


@pytest.mark.slow  # three compiles and four child processes
def test_ab_times_each_change_against_its_absence(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.ab", "--quick", "--reps", "2", "--rounds", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(":")[0] for r in rows] == ["| freeze", "| huge pages", "| huge pages"]
    for row in rows:
        before, after, ratio = (cell.strip() for cell in row.split("|")[2:5])
        assert float(before) > 0 and float(after) > 0 and ratio.endswith("x")
    assert proc.stdout.startswith("machine: ")


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--reps", "0"], ["--rounds", "-1"]])
def test_ab_bad_usage_exits_2_with_one_line(argv, capsys):
    from bench.ab import main as ab_main

    assert ab_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m bench.ab: ") and "\n" not in err
