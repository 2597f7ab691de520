"""`python -m train lower`: the train step and inference exported for TPU and CUDA on an abstract mesh, on
this CPU host, with the kernel each layer was promised found in the lowered module; bad input is one line
and exit 2; and what ran per layer is recorded in run.json.

Fast: the tiny config on a few layouts. Slow: every config of configs/ x layout x platform.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from tests.conftest import ROOT, TINY
from train.__main__ import main

# Packed training rows (segment ids) and bf16: the Pallas GPU kernel in training, cuDNN for the padded eval.
PACKED = ["data.packing=true", "model.pooler.pooling=mean"]


def run(*argv: str) -> int:
    """`python -m train ...` in this process: its exit code (argparse's usage errors exit from inside)."""
    try:
        return main(list(argv))
    except SystemExit as done:
        return int(done.code or 0)


def lower_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = run("lower", "--config", str(TINY), "--json", *args)
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def kernels(report: dict, call: str) -> list[tuple[str, bool, list[str]]]:
    """(kernel, found, kernel names in the program) per layer of a call."""
    entry = next(c for c in report["calls"] if c["call"] == call)
    assert entry["lowered"], entry["error"]
    return [(x["kernel"], x["ok"], x["found"]) for x in entry["layers"]]


def test_tpu_every_layer_runs_splash_in_the_lowered_train_step_and_inference(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # writes nothing but --out: the working directory stays empty
    code, report = lower_json(capsys, "--platform", "tpu", "--layout", "dp+fsdp+tp", "--out", str(tmp_path / "hlo"),
                              *PACKED)
    assert code == 0 and report["ok"]
    assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2} | {
        a: 1 for a in report["mesh"] if a not in ("data", "fsdp", "tensor")}
    train, infer = kernels(report, "train"), kernels(report, "eval")
    assert len(train) == len(infer) == 2
    for kernel, found, names in train:
        assert kernel == "splash" and found
        assert {"splash_mqa_fwd_segmented_residuals", "splash_mqa_dkv_segmented_no_residuals (backward)",
                "splash_mqa_dq_segmented_no_residuals (backward)"} <= set(names)
    for kernel, found, names in infer:
        assert kernel == "splash" and found and names == ["splash_mqa_fwd_segmented_no_residuals"]
    memory = report["memory"]
    assert 0 < memory["parameters"] < memory["parameters_global"]  # fsdp and tensor split the parameters
    assert memory["gradients"] == memory["parameters"]
    assert memory["total"] == memory["parameters"] + memory["gradients"] + memory["optimizer_state"]
    assert [p.name for p in tmp_path.iterdir()] == ["hlo"]
    assert sorted(p.name for p in (tmp_path / "hlo").iterdir()) == ["eval.mlir", "train.mlir"]
    assert "tpu_custom_call" in (tmp_path / "hlo" / "train.mlir").read_text()


def test_cuda_finds_the_pallas_kernel_for_packed_rows_and_does_not_claim_the_cudnn_it_could_not_trace():
    from train.aot.lower import lower, render, resolve

    target = resolve(str(TINY), ["model.block.dtype=bfloat16", "model.num_layers=1", *PACKED], "cuda", 8, "dp+tp")
    report = lower(target, "cuda", str(TINY))
    train, infer = report.calls
    assert train.ok
    for layer in train.layers:
        assert layer.kernel == "pallas_gpu" and layer.ok
        assert any(name.startswith("mha_forward") for name in layer.found), layer.found
    for layer in infer.layers:  # padded bf16 rows: cuDNN, which this host cannot trace without the CUDA plugin
        assert layer.kernel == "cudnn" and layer.substitute == "xla" and not layer.found
    assert not infer.ok and not report.ok
    text = render(report)
    assert "NOT CHECKED: cuDNN needs the CUDA plugin to be traced; lowered with xla" in text
    assert text.splitlines()[-1].startswith("result: INCOMPLETE: cuDNN could not be traced on this host (eval layer")


def test_a_promised_kernel_missing_from_the_module_fails_with_exit_1(capsys, monkeypatch):
    from train.aot import programs

    # Pretend the XLA kernel leaves a custom call: the lowered program (plain XLA) does not hold it.
    monkeypatch.setitem(programs.KERNEL_TARGETS, "xla", ("__no_such_target",))
    code = main(["lower", "--config", str(TINY), "--platform", "cuda", "--layout", "single", "model.num_layers=1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "MISSING from the program" in out and out.strip().splitlines()[-1].startswith("result: FAILED")


@pytest.mark.parametrize(("args", "says"), [
    (["--platform", "rocm"], "invalid choice: 'rocm'"),
    (["--platform", "tpu", "--devices", "0"], "'0' is not a device count"),
    (["--platform", "tpu", "parallel.mesh.data=3"], "parallel.mesh"),
    (["--platform", "tpu", "--layout", "dp+fsdp+tp", "--devices", "6"], "needs a multiple of 4 devices"),
    (["--platform", "tpu", "--layout", "single", "--devices", "8"], "--layout single is one device"),
    (["--platform", "tpu", "--layout", "dp", "parallel.mesh.fsdp=2"], "pass one of them"),
    (["--platform", "tpu", "--layout", "dp", "--devices", "64"], "train.batch_size=32 (global) does not split"),
    (["--platform", "tpu", "optim.lrr=1"], "did you mean 'optim.lr'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, says):
    assert run("lower", "--config", str(TINY), *args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and says in captured.err


def test_a_missing_config_is_one_line_and_exit_2(capsys, tmp_path):
    assert run("lower", "--config", str(tmp_path / "nope.yaml"), "--platform", "tpu") == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not found" in err


def test_init_from_a_run_that_is_not_here_lowers_the_shape_the_config_states(tmp_path):
    from train.aot.lower import resolve

    missing = tmp_path / "no-run"
    target = resolve(str(TINY), [f"model.init_from={missing}", "model.num_layers=3"], "tpu")
    assert target.config.model.num_layers == 3
    assert any("holds no run on this machine" in note for note in target.notes)


def test_sharded_optimizer_state_follows_its_parameters_with_frozen_ones(tiny):
    """optim.freeze leaves frozen parameters without moments; the sharded runner's state shardings still
    give every moment its parameter's sharding (they once failed to build on any mesh of > 1 device)."""
    from jax.sharding import AbstractMesh, AxisType

    from train.config import MESH_AXES
    from train.devices.mesh import logical_rules, param_shardings, state_shardings
    from train.loop.state import abstract_init, create_state
    from train.tasks import task_for

    cfg = tiny("optim.freeze=[embedding]", "model.vocab_size=20", "model.num_classes=2")
    model = task_for(cfg).build_model(cfg.model)
    params, specs = abstract_init(model, 16)
    state = jax.eval_shape(lambda p: create_state(model, p, cfg.optim, 10), params)
    sizes = {"fsdp": 4, "tensor": 2}
    mesh = AbstractMesh(tuple(sizes.get(a, 1) for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))
    params_sh, _ = param_shardings(specs, params, mesh, logical_rules(cfg.parallel))
    state_sh = state_shardings(state, params_sh, mesh)
    opt_sh = state_sh.opt_state
    by_param = {jax.tree_util.keystr(p): sh for p, sh in jax.tree_util.tree_flatten_with_path(params_sh)[0]}
    moments = [(jax.tree_util.keystr(p), sh) for p, sh in jax.tree_util.tree_flatten_with_path(opt_sh)[0]
               if ".mu" in jax.tree_util.keystr(p)]
    assert moments and not any(path.endswith("['encoder']['embedding']") for path, _ in moments)
    for path, sh in moments:
        assert sh == next(by_param[name] for name in by_param if path.endswith(name)), path

    from train.aot.report import state_memory

    memory = state_memory(state, state_sh, cfg.optim.freeze)  # the frozen table has no gradient and no moments
    table = params["encoder"]["embedding"]
    assert memory["parameters"] - memory["gradients"] == table.size * 4 // 8  # [V, D]: V over tensor, D over fsdp


def test_run_json_records_each_layers_kernel_for_the_train_and_eval_calls(reference_run):
    workdir, _ = reference_run
    session = json.loads((workdir / "run.json").read_text())["sessions"][-1]
    record = session["attention"]
    assert record["platform"] == "cpu"
    assert record["dropout_mask"]["kernel"] == "threefry_unrolled" and "CPU" in record["dropout_mask"]["reason"]
    assert record["projection"]["kernel"] == "smaller_operand_transposed" and "CPU" in record["projection"]["reason"]
    assert record["layer_norm"]["kernel"] == "written_backward" and "CPU" in record["layer_norm"]["reason"]
    assert record["recompute"]["kernel"] == "saved" and "CPU" in record["recompute"]["reason"]
    for call in ("train", "eval"):
        (group,) = record[call]  # tiny: one bucket length, one choice for it
        assert group["lengths"] == [16]
        assert [x["layer"] for x in group["layers"]] == [0, 1]
        assert all(x["kernel"] == "dense" and "CPU" in x["reason"] for x in group["layers"])


# --- the grid ---------------------------------------------------------------------------------------------


ACCELERATOR_CONFIGS = {"bert_base_mlm_l128", "bert_base_mlm_l512", "modernbert_long", "sentiment_pretrained_accel"}


def _configs() -> list[Path]:
    return sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("config", _configs(), ids=lambda p: p.stem)
def test_every_config_lowers_on_every_layout(config, platform):
    """Every config x layout (single, DP, FSDP, TP and their mixes, context where the mesh has it) lowers,
    and every layer's promised kernel is in the module. On TPU every layer runs splash, in training too
    unless attention-weight dropout is on (then the unfused path: no fused kernel has dropout; the
    accelerator configs turn it off) or the layout splits the sequence (the context-parallel kernel)."""
    from train.aot.lower import lower, resolve
    from train.aot.shapes import LAYOUTS

    problems = []
    for layout in LAYOUTS:
        target = resolve(str(config), [], platform, None if layout == "single" else 8, layout)
        report = lower(target, platform, str(config))
        problems += [f"{layout} {c.call}: {c.error}" for c in report.calls if not c.lowered]
        problems += [f"{layout} {c.call} layer {x.layer}: {x.kernel} not in the program" for c in report.calls
                     for x in c.layers if c.lowered and not x.ok]
        if platform != "tpu":
            continue
        dropout = target.config.model.block.attention.dropout > 0
        for call in report.calls:
            allowed = {"splash"} | ({"context"} if target.mesh.get("context", 1) > 1 else set())
            allowed |= {"unfused"} if call.call == "train" and dropout else set()
            problems += [f"{layout} {call.call} layer {x.layer}: {x.kernel}" for x in call.layers
                         if x.kernel not in allowed]
        if config.stem in ACCELERATOR_CONFIGS:
            assert not dropout, "a TPU config keeps the fused kernel: model.block.attention.dropout=0"
    assert not problems, problems
