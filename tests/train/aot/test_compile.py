"""`python -m train compile`: the steps compiled by the TPU compiler (libtpu, compile-only devices) on this CPU
host: memory per chip against the chip's usable memory, the kernel per layer, the collectives, exit codes.

Fast: the tiny config on v5e-8 (fits, splash in every layer), a state no chip holds (exit 1, one result line),
and the refusals of bad input. Slow: the GPU compiler (its own venv), `--fit`, `--save`, every config on every
layout and target (bench/compile_grid.py), v5e-256 and two slices.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY
from train.__main__ import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as done:
        code = int(done.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_tiny_config_fits_a_v5e_8_with_splash_in_every_layer(capsys, tmp_path):
    code, out, err = run(capsys, "compile", "--config", str(TINY), "--target", "v5e-8", "--json",
                         "--dump", str(tmp_path / "dump"))
    report = json.loads(out)
    assert code == 0 and report["fits"] and report["ok"] and err == ""
    assert (report["target"], report["chips"], report["hosts"], report["chip"]) == ("v5e-8", 8, 1, "TPU v5 lite")
    per_chip = report["per_device_bytes"]
    assert per_chip["usable"] == int(15.75 * 2**30)  # the compiler's own limit for a v5e
    assert per_chip["arguments"] > 0 and per_chip["temporaries"] > 0 and 0 < per_chip["total"] < per_chip["usable"]
    assert 0 <= per_chip["optimizer_state"] - 2 * per_chip["parameters"] < 1024  # Adam's two moments, and counters
    # The compiler's live ranges: at their peak the parameters and Adam's moments in use are live, and no more
    # than the heap it reserves.
    state = per_chip["parameters"] + per_chip["optimizer_state"]
    assert state < per_chip["live_at_peak"] <= per_chip["total"], per_chip
    assert [x["kernel"] for x in report["layers"]] == ["splash", "splash"]
    for layer in report["layers"]:
        assert layer["ok"] and any(name.startswith("splash_mqa_fwd") for name in layer["found"])
        assert any(name.endswith("(backward)") for name in layer["found"])
    assert report["collectives"]["all-reduce"] > 0  # data parallel: the gradients are summed over the chips
    train, infer = report["calls"]
    assert train["compiled"] and infer["compiled"] and train["seconds"] > 0 and train["flops"] > 0
    for call in ("train", "eval"):  # --dump keeps the compiler's program and its memory report for each step
        kept = {p.name.split(".")[-2] for p in (tmp_path / "dump" / call).glob("*.txt")}
        assert {"after_optimizations", "after_optimizations-memory-usage-report"} <= kept, kept


def test_a_state_no_chip_holds_exits_1_with_what_it_needs_and_the_levers(capsys):
    code, out, err = run(capsys, "compile", "--config", str(TINY), "--target", "v5e-8", "model.block.ffn_dim=100000000")
    assert code == 1 and err == ""
    last = out.strip().splitlines()[-1]
    assert last.startswith("result: DOES NOT FIT: the train step needs ") and "a v5e has 15.75 GiB usable" in last
    assert "model.remat=full" in last and "--layout fsdp" in last and "train.batch_size" in last
    assert "RESOURCE_EXHAUSTED" in out  # the compiler's own refusal is quoted in the report


def test_the_levers_name_the_loss_in_groups_for_a_masked_lm_that_keeps_its_logits() -> None:
    from types import SimpleNamespace

    from train.aot.compiled import levers
    from train.aot.report import describe_model
    from train.config import config_from_dict

    def said(**mlm: int) -> str:
        config = config_from_dict({"task": "mlm", "data": {"source": "generated_corpus"}, "mlm": mlm})
        model = describe_model(config, "mlm")
        return levers(SimpleNamespace(model=model, mesh="data=8", target=SimpleNamespace(chips=8)))  # type: ignore[arg-type]

    assert "mlm.loss_chunks=8" in said()
    assert "mlm.loss_chunks" not in said(loss_chunks=4)
    assert describe_model(config_from_dict({"task": "mlm", "data": {"source": "generated_corpus"},
                                            "mlm": {"loss_chunks": 4}}), "mlm").endswith(", loss in 4 groups")


@pytest.mark.parametrize(("args", "says"), [
    (["--target", "v7x-8"], "not a TPU slice or GPU node set"),
    (["--target", "v4-7"], "counts 2 cores per chip"),
    (["--target", "v5e-12"], "no v5e slice has 12 chips"),
    (["--target", "v5e:2x2x2"], "a v5e topology has 2 dimensions"),
    (["--target", "h100-12"], "GPUs come 8 to a host"),
    (["--target", "v5e-8", "--slices", "0"], "--slices 0"),
    (["--target", "v5e-8", "--layout", "dp+fsdp+tp", "train.batch_size=6"], "does not split over"),
    (["--target", "v5e-8", "optim.lrr=1"], "did you mean 'optim.lr'"),
    (["--target", "v5e-8", "--fit", "--dump", "d"], "--dump and --save go with a single compile"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, says):
    code, out, err = run(capsys, "compile", "--config", str(TINY), *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and says in err, err


def test_a_missing_compiler_names_its_install_in_one_line_with_exit_2(capsys, monkeypatch):
    from train.aot import targets

    monkeypatch.setattr(targets, "compiler_installed", lambda platform: False)
    code, out, err = run(capsys, "compile", "--config", str(TINY), "--target", "h100-8")
    assert code == 2 and out == ""
    assert err.strip() == ("error: --target h100-8 needs the GPU compiler, which is not installed: "
                           f"{targets.INSTALL['cuda']}")


@pytest.mark.slow
def test_fit_finds_the_largest_per_chip_batch_for_each_remat_policy(capsys):
    code, out, err = run(capsys, "compile", "--config", str(TINY), "--target", "v5e-8", "--fit", "--json",
                         "model.block.ffn_dim=2000000")
    table = json.loads(out)
    assert code == 0 and table["any_fits"]
    rows = {row["remat"]: row for row in table["rows"]}
    assert set(rows) == {"none", "dots", "full"}
    # One progress line on stderr per probe, as it ends.
    assert len(err.strip().splitlines()) == sum(len(row["probes"]) for row in rows.values())
    assert all(line.startswith("fit: remat ") for line in err.strip().splitlines()), err
    for row in rows.values():
        fits = {p["per_chip"]: p["fits"] for p in row["probes"]}
        assert fits[row["largest"]] and not fits.get(row["largest"] + 1, False)
        assert row["global_batch"] == row["largest"] * 8
    assert rows["full"]["largest"] >= rows["none"]["largest"]


@pytest.mark.slow
def test_fsdp_on_a_tpu_gathers_weights_instead_of_passing_activations_around():
    """Without its compiler options the TPU compiler turns the FSDP matmuls into windowed-einsum loops of
    collective-permutes (120 in this step) and needs more memory; with them, the weights are all-gathered."""
    # In a process of its own: the suite's JAX settings (tests/conftest.py) are not a training run's.
    done = subprocess.run([sys.executable, "-m", "train", "compile", "--config", str(ROOT / "configs" /
                           "bert_base_mlm_l128.yaml"), "--target", "v5e-8", "--layout", "fsdp", "--json",
                           "model.num_layers=2", "train.batch_size=64"], cwd=ROOT, capture_output=True, text=True)
    report = json.loads(done.stdout)
    assert done.returncode == 0 and "fsdp=8" in str(report["mesh"]), done.stderr[-2000:]
    for call in report["calls"]:
        assert call["collectives"].get("collective-permute", 0) == 0, call["collectives"]
        assert call["collectives"].get("all-gather", 0) > 0


def test_the_windowed_einsum_options_go_to_tpu_fsdp_steps_only():
    from jax.sharding import AbstractMesh

    from train.devices.steps import NO_WINDOWED_EINSUM, compiler_options

    fsdp = AbstractMesh((2, 4), ("data", "fsdp"))
    assert compiler_options(fsdp, "tpu") == NO_WINDOWED_EINSUM
    assert compiler_options(AbstractMesh((8, 1), ("data", "fsdp")), "tpu") == {}
    assert compiler_options(fsdp, "cuda") == {} and compiler_options(fsdp, "cpu") == {}


@pytest.mark.slow
def test_save_writes_the_compiled_train_step_with_what_loading_needs(capsys, tmp_path):
    path = tmp_path / "step.bin"
    code, _, _ = run(capsys, "compile", "--config", str(TINY), "--target", "v5e-8", "--save", str(path))
    assert code == 0 and path.stat().st_size > 0
    header = json.loads((tmp_path / "step.bin.json").read_text())
    assert header["target"] == "v5e-8" and header["versions"]["jax"] and header["versions"]["libtpu"]
    assert "on a host of this target" in header["load"]
    with open(path, "rb") as f:  # the file unpickles on a host without the chip (loading the executable needs it)
        saved = pickle.load(f)
    assert saved["in_tree"].num_leaves == header["arguments"] > 10 and saved["out_tree"].num_leaves == header["outputs"]
    assert saved["header"] == header and len(saved["executable"]) > 1000


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e-256", "v4-8", "v5p-8", "v6e-8"])
def test_other_slices_compile_the_tiny_config(capsys, target):
    code, out, _ = run(capsys, "compile", "--config", str(TINY), "--target", target, "--json", "train.batch_size=256")
    report = json.loads(out)
    assert code == 0 and report["fits"], out[-2000:]
    assert report["chips"] == {"v5e-256": 256, "v4-8": 4, "v5p-8": 4, "v6e-8": 8}[target]


@pytest.mark.slow
def test_two_slices_compile_with_the_batch_split_over_both(capsys):
    code, out, _ = run(capsys, "compile", "--config", str(TINY), "--target", "v5e-8", "--slices", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["chips"] == 16 and report["hosts"] == 2 and report["slices"] == 2


# --- the GPU compiler: its own venv (the CUDA plugin beside libtpu would start on every JAX import; the gpu_python
# fixture, tests/train/aot/conftest.py) -----------------------------------------------------------------------------


@pytest.mark.slow
def test_h100_8_compiles_the_main_job_in_bfloat16_with_the_pallas_gpu_kernel_for_packed_rows(gpu_python):
    proc = subprocess.run([gpu_python, "-m", "train", "compile", "--config", "configs/sentiment.yaml", "--target",
                           "h100-8", "--json", "model.block.dtype=bfloat16", "model.block.attention.dropout=0.0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert proc.stderr == ""  # no plugin traceback: compile runs on cpu
    report = json.loads(proc.stdout)
    assert report["chip"] == "NVIDIA H100 80GB HBM3" and report["chips"] == 8 and report["fits"]
    assert all(x["kernel"] == "pallas_gpu" and x["ok"] for x in report["layers"])
    infer = report["calls"][1]["layers"]
    assert all(x["kernel"] == "cudnn" and x["ok"] for x in infer)  # padded bf16 rows: cuDNN's fused attention


@pytest.mark.slow
def test_with_attention_dropout_the_gpu_step_shows_no_attention_kernel_per_layer(gpu_python):
    proc = subprocess.run([gpu_python, "-m", "train", "compile", "--config", "configs/sentiment.yaml", "--target",
                           "h100-8", "model.block.dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "unfused    ok  plain XLA: no attention custom call" in proc.stdout


def test_the_compile_command_starts_jax_on_cpu_only(monkeypatch):
    from train import platforms

    env: dict[str, str] = {}
    assert platforms.choose("compile", env) == "cpu" and env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
    assert platforms.choose("compile", {"JAX_PLATFORMS": "cuda"}) is None  # the user's choice stands
    monkeypatch.setattr(platforms, "_installed", lambda name: name == "libtpu")
    monkeypatch.setattr(platforms, "_has_tpu", lambda: False)
    env = {}
    assert platforms.choose("train", env) == "cpu"  # libtpu installed, no TPU here: not started
    monkeypatch.setattr(platforms, "_has_tpu", lambda: True)
    env = {}
    assert platforms.choose("train", env) is None and "JAX_PLATFORMS" not in env  # a TPU VM: JAX's own choice


@pytest.mark.slow
def test_a_train_command_in_a_venv_with_libtpu_prints_no_libtpu_warnings(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train", "schema"], cwd=ROOT, capture_output=True, text=True,
                          env={k: v for k, v in __import__("os").environ.items() if k != "JAX_PLATFORMS"}, timeout=300)
    assert proc.returncode == 0 and proc.stderr == ""


def test_a_tpu_reduce_scatter_counts_as_one_each_though_the_compiler_writes_it_as_an_all_reduce():
    """libtpu writes each reduce-scatter as an all-reduce inside an `all-reduce-scatter.N` computation, every such
    computation with the same channel id; a gradient summed whole is a plain all-reduce."""
    from train.aot.programs import collectives

    def scatter(n: int) -> str:
        return (f"%all-reduce-scatter.{n} (input_0: bf16[768,3072]) -> bf16[96,3072] {{\n"
                f"  %input_0 = bf16[768,3072]{{1,0}} parameter(0)\n"
                f"  %all-reduce.{n} = bf16[768,3072]{{1,0}} all-reduce(%input_0), channel_id=1, "
                "replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add\n"
                f"  ROOT %slice.{n} = bf16[96,3072]{{1,0}} slice(%all-reduce.{n}), slice={{[0:96], [0:3072]}}\n}}\n")

    hlo = (scatter(1) + scatter(2) + "ENTRY %main (p: f32[768]) -> f32[768] {\n"
           "  %p = f32[768]{0} parameter(0)\n"
           "  ROOT %all-reduce.9 = f32[768]{0} all-reduce(%p), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, "
           "use_global_device_ids=true, to_apply=%add\n}\n")
    counts = collectives(hlo)
    assert (counts["reduce-scatter"], counts["all-reduce"]) == (2, 1), counts
