"""`python -m train lower --config C --platform tpu|cuda [--devices 8] [--layout L] [--out DIR] [key=value ...]`.

The run's train step and its inference (the eval step: the forward pass with train=False) traced and lowered
to StableHLO for an accelerator, on this host, without its compiler: the steps are built by the code that
builds them for training (train/devices/steps.py), on an abstract mesh of N devices with the run's shardings
and the attention kernels chosen for that platform. It reports, per layer and call, the kernel the dispatch
promised, its reason, and whether the lowered program holds it (train/aot/programs.py); the parameters,
gradients and optimizer state per device from the shardings; the collectives written into the program
(those inside shard_map). `--out DIR` writes each call's StableHLO there.

What only the chip's compiler knows (activations and temporaries, whether it fits, the collectives its
partitioner inserts) is `python -m train compile`'s.

cuDNN's attention cannot be traced without the CUDA plugin ("cuDNN is not detected"): on such a host a call
whose layers the dispatch sends to cuDNN is lowered again with the kernel the dispatch runs without cuDNN
(XLA's), the report says so per layer, and the result is INCOMPLETE (exit 1): nothing was checked for those
layers.

Exit codes: 0 every kernel the dispatch promised is in the lowered program; 1 one is missing or could not be
traced, or a step did not lower; 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType

from train.aot import programs, shapes
from train.aot.report import (
    LayerResult,
    check_layers,
    counts_text,
    describe_model,
    found_text,
    heading,
    layer_lines,
    one_line_error,
    size,
    state_memory,
)
from train.cli import Parser, program
from train.config import MESH_AXES
from train.errors import FAILED_EXIT, OK_EXIT

PLATFORMS = ("tpu", "cuda")
DEFAULT_DEVICES = 8


@dataclasses.dataclass
class CallResult:
    call: str  # 'train' or 'eval'
    shapes: str  # what the batch looks like
    lowered: bool
    error: str | None
    layers: list[LayerResult]
    module_bytes: int = 0
    collectives: dict[str, int] = dataclasses.field(default_factory=dict)  # written into the program

    @property
    def ok(self) -> bool:
        return self.lowered and all(layer.ok and layer.substitute is None for layer in self.layers)


@dataclasses.dataclass
class Report:
    config: str
    platform: str
    devices: int
    mesh: dict[str, int]
    layout: str
    model: str
    calls: list[CallResult]
    memory: dict[str, int]  # bytes per device: parameters, gradients, optimizer_state, total; and *_global
    replicated_dims: list[str]
    notes: list[str]

    @property
    def ok(self) -> bool:
        return all(call.ok for call in self.calls)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        for call, raw in zip(self.calls, out["calls"], strict=True):
            raw["ok"] = call.ok
        return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device count: pass a whole number >= 1")
    return value


def _parser() -> Parser:
    p = Parser(prog=f"{program()} lower", description=(
        "Lower a config's train step and inference to StableHLO for TPU or CUDA on an abstract mesh of N devices, "
        "on this machine, and report per layer the attention kernel and whether it is in the lowered program, and "
        "the state's memory per device. Memory per chip and fit: python -m train compile."),
        epilog="exit codes: 0 every kernel the dispatch promised is in the lowered programs; 1 one is missing or "
        "could not be traced, or a step did not lower (the line says why); 2 bad input (one line)")
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--platform", required=True, choices=PLATFORMS, help="the accelerator to lower for")
    p.add_argument("--devices", type=_positive, default=None, metavar="N",
                   help=f"accelerator devices in the mesh (default {DEFAULT_DEVICES}; 1 with --layout single)")
    p.add_argument("--layout", choices=list(shapes.LAYOUTS), default=None,
                   help="a mesh preset for N devices (default: the config's parallel.mesh, or parallel.mesh.* "
                   "overrides): " + "; ".join(f"{k}: {shapes.describe_layout(k)}" for k in shapes.LAYOUTS))
    p.add_argument("--out", metavar="DIR", help="write each call's StableHLO into DIR (train.mlir, eval.mlir)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. data.packing=true")
    return p


def resolve(config_path: str, overrides: list[str], platform: str, devices: int | None = None,
            layout: str | None = None) -> shapes.Resolved:
    """The config to lower and its mesh (ConfigError on bad input)."""
    from train.config import ConfigError

    if platform not in PLATFORMS:
        raise ConfigError(f"unknown platform {platform!r}: use one of {', '.join(PLATFORMS)}")
    if layout == "single" and devices not in (None, 1):
        raise ConfigError(f"--layout single is one device, not --devices {devices}: drop --devices or pick "
                          f"another layout ({', '.join(k for k in shapes.LAYOUTS if k != 'single')})")
    n = 1 if layout == "single" else DEFAULT_DEVICES if devices is None else devices
    return shapes.resolve(config_path, overrides, n, layout)


def lower(resolved: shapes.Resolved, platform: str, config_path: str = "", out: Path | None = None) -> Report:
    """Lower the train and eval steps of `resolved` for `platform` and check them (the command but printing)."""
    from train.devices.mesh import logical_rules

    config = resolved.config
    mesh = AbstractMesh(tuple(resolved.mesh[a] for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))
    run = shapes.abstract(config, mesh)
    rules = logical_rules(config.parallel)
    calls = [_lower_call(call, run, batch, shapes_text, config, mesh, rules, platform, out)
             for call, (batch, shapes_text) in run.batches.items()]
    memory = state_memory(run.state, run.state_sharding, config.optim.freeze)
    return Report(config_path, platform, resolved.devices, resolved.mesh, resolved.layout,
                  describe_model(config, run.task.name), calls, memory, run.replicated_dims, resolved.notes)


def _lower_call(call: str, run: shapes.Abstract, batch: dict[str, Any], shapes_text: str, config: Any, mesh: Any,
                rules: Any, platform: str, out: Path | None) -> CallResult:
    from train.devices.steps import kernel_context

    strategy = config.parallel.context_strategy
    length, packed = batch["tokens"].shape[1], "segment_ids" in batch
    substitute = None
    try:
        lowered = _lowered(call, run, run.model, batch, config, mesh, rules, platform)
    except Exception as err:  # any failure to trace or lower is the answer, in one line
        with kernel_context(mesh, rules, strategy, platform):
            promised = check_layers(config, call, length, packed, None)
        if not ("cuDNN" in str(err) and any(layer.kernel == "cudnn" for layer in promised)):
            return CallResult(call, shapes_text, False, one_line_error(err), promised)
        # No CUDA plugin here: lower the call with the kernel the dispatch runs without cuDNN.
        fallback = config.model_copy(update={"model": config.model.with_kernel("xla")})
        with kernel_context(mesh, rules, strategy, platform):
            substitute = [(x.kernel, x.reason) for x in check_layers(fallback, call, length, packed, None)]
        try:
            lowered = _lowered(call, run, run.task.build_model(fallback.model), batch, config, mesh, rules, platform)
        except Exception as again:
            return CallResult(call, shapes_text, False, one_line_error(again), promised)
    hlo = lowered.as_text(dialect="hlo", debug_info=True)
    stablehlo = lowered.as_text()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{call}.mlir").write_text(stablehlo)
    with kernel_context(mesh, rules, strategy, platform):
        layers = check_layers(config, call, length, packed, hlo, substitute)
    return CallResult(call, shapes_text, True, None, layers, len(stablehlo.encode()), programs.collectives(hlo))


def _lowered(call: str, run: shapes.Abstract, model: Any, batch: dict[str, Any], config: Any, mesh: Any, rules: Any,
             platform: str) -> Any:
    """The call's step (train/devices/steps.py), traced and lowered for `platform`."""
    from train.devices.steps import mesh_steps

    state = run.sharded_state().replace(apply_fn=model.apply)
    steps = mesh_steps(run.task, mesh, rules, config.parallel.context_strategy,
                       jax.tree.leaves(run.state_sharding), platform=platform)
    with programs.name_stacks():
        traced = steps.train.trace(state, batch, run.rng(mesh)) if call == "train" else steps.eval.trace(state, batch)
        return traced.lower(lowering_platforms=(platform,))


def render(report: Report) -> str:
    lines = heading(f"{report.config or 'config'} lowered for {report.platform} on {report.devices} "
                    f"device{'s' if report.devices > 1 else ''}: {_mesh_text(report.mesh)}", report.layout,
                    report.model, report.notes)
    for call in report.calls:
        title = "train step" if call.call == "train" else "inference (eval step, train=False)"
        lines.append("")
        if not call.lowered:
            lines.append(f"{title}: NOT lowered for {report.platform}: {call.error}")
            continue
        lines.append(f"{title}: {call.shapes}; lowered for {report.platform} ({size(call.module_bytes)} StableHLO)")
        lines += layer_lines(call.layers, _status)
        lines.append(f"  collectives written into the program (e.g. inside shard_map): {counts_text(call.collectives)}")
    m = report.memory
    lines += ["", "state per device (from the shardings; activations and temporaries: python -m train compile):",
              f"  parameters       {size(m['parameters']):>10}  (of {size(m['parameters_global'])} in all)",
              f"  gradients        {size(m['gradients']):>10}"
              f"{'' if m['gradients'] == m['parameters'] else '  (the trained parameters: optim.freeze)'}",
              f"  optimizer state  {size(m['optimizer_state']):>10}  (of {size(m['optimizer_state_global'])} in all)",
              f"  total            {size(m['total']):>10}"]
    if report.replicated_dims:
        lines.append(f"  kept whole on every device (their mesh axes do not divide them): "
                     f"{len(report.replicated_dims)} dims, e.g. {report.replicated_dims[0]}")
    lines.append("")
    untraced = [f"{c.call} layers {', '.join(str(x.layer) for x in c.layers if x.substitute)}" for c in report.calls
                if any(x.substitute for x in c.layers)]
    failed = [f"{c.call}: " + ("not lowered" if not c.lowered else
                               "layers " + ", ".join(str(x.layer) for x in c.layers if not x.ok))
              for c in report.calls if not c.lowered or any(not x.ok for x in c.layers)]
    if failed:
        lines.append(f"result: FAILED ({'; '.join(failed)})")
    elif untraced:
        lines.append(f"result: INCOMPLETE: cuDNN could not be traced on this host ({'; '.join(untraced)}): install "
                     "the GPU compiler (docs/accelerators.md) and lower again, or python -m train compile")
    else:
        lines.append("result: OK, every kernel the dispatch promised is in the lowered programs")
    return "\n".join(lines)


def _status(layer: LayerResult) -> str:
    if layer.substitute:
        return (f"NOT CHECKED: cuDNN needs the CUDA plugin to be traced; lowered with {layer.substitute}, the "
                f"dispatch's kernel without cuDNN: {found_text(layer)}")
    if programs.KERNEL_TARGETS.get(layer.kernel) is None:
        return f"plain XLA: {found_text(layer)}"
    return f"{'in the program' if layer.ok else 'MISSING from the program'}: {found_text(layer)}"


def _mesh_text(mesh: dict[str, int]) -> str:
    sized = [f"{axis}={n}" for axis, n in mesh.items() if n > 1]
    return " ".join(sized) if sized else "one device"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    resolved = resolve(args.config, args.overrides, args.platform, args.devices, args.layout)
    report = lower(resolved, args.platform, args.config, Path(args.out) if args.out else None)
    print(json.dumps(report.to_json(), indent=1) if args.json else render(report))
    return OK_EXIT if report.ok else FAILED_EXIT


if __name__ == "__main__":
    sys.exit(main())
