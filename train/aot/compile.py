"""`python -m train compile --config C --target T [--layout L] [--slices S] [--fit] [--save FILE] [--json] [k=v ...]`.

"Will this fit on my slice?", answered by the chip's own compiler on this host, with no chip: the run's train
and eval steps are built by the code that builds them for training (train/devices/steps.py) on a mesh of the
target's compile-only devices (train/aot/targets.py), with the attention kernels chosen for the target, and
compiled. It reports the chip, chips and hosts; per call the compile time, the memory per chip from the
compiler's analysis (arguments, outputs, temporaries, the peak against the chip's usable memory) beside the
state's share from the shardings (parameters, gradients, optimizer state); the attention kernel each layer
runs in the compiled program; the collectives the partitioner inserted, by kind; and the FLOPs per chip
where the compiler counts them (TPU).

Not fitting is an answer: exit 1 with one line, "needs X GiB per chip, a v5e has Y GiB usable", the largest
buffers of the compiled program and the levers that would fit. `--fit` searches, for each rematerialization
policy the model offers (model.remat none, dots, full), the largest per-chip batch that fits (each probe one
compile of the train step). `--save FILE` writes the compiled train step (jax.experimental.serialize_executable)
with the versions and target it needs; loading it needs that hardware.

Exit codes: 0 it fits and every kernel the dispatch promised is in the compiled program; 1 it does not fit, a
kernel is missing, or the compiler refused the program (the line says why); 2 bad input, or the target's
compiler is not installed (one line naming the install).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any

from train.aot import programs, shapes, targets
from train.aot.report import LayerResult, check_layers, describe_model, one_line_error, state_memory
from train.cli import Parser, program
from train.errors import FAILED_EXIT, OK_EXIT

REMAT_POLICIES = ("none", "dots", "full")


@dataclasses.dataclass
class Compiled:
    """One call (train or eval) compiled for the target."""

    call: str
    shapes: str
    compiled: bool
    error: str | None
    seconds: float
    memory: dict[str, int]  # bytes per chip: arguments, outputs, aliases, temporaries, generated_code, total
    layers: list[LayerResult]
    collectives: dict[str, int]
    flops: float | None
    largest: list[str]  # the largest buffers of the program, described
    largest_at: int | None = None  # refused for want of memory: the per-chip batch whose program named them
    executable: Any = dataclasses.field(default=None, repr=False)

    def fits(self, usable: int, platform: str) -> bool:
        """A TPU program fits when the TPU compiler accepts it: it refuses one that does not, and near its
        limit it rematerializes values to fit, so its accepted programs may report a peak above the limit. XLA's
        GPU compiler checks nothing: its peak must be within the usable memory."""
        return self.compiled and (platform == "tpu" or self.memory["total"] <= usable)

    @property
    def out_of_memory(self) -> bool:
        """The compiler refused the program for want of memory (its figure is memory['total'])."""
        return not self.compiled and "total" in self.memory

    @property
    def kernels_ok(self) -> bool:
        return self.compiled and all(layer.ok for layer in self.layers)


@dataclasses.dataclass
class Result:
    config: str
    target: targets.Target
    chip: str
    mesh: str
    layout: str
    model: str
    notes: list[str]
    usable: int
    state: dict[str, int]  # the state's share per chip, from the shardings
    calls: list[Compiled]

    @property
    def fits(self) -> bool:
        return all(c.fits(self.usable, self.target.platform) for c in self.calls)

    @property
    def ok(self) -> bool:
        return self.fits and all(c.kernels_ok for c in self.calls)

    def to_json(self) -> dict[str, Any]:
        train = next((c for c in self.calls if c.call == "train"), self.calls[0])
        return {
            "target": self.target.name, "platform": self.target.platform, "chip": self.chip,
            "chips": self.target.chips, "hosts": self.target.hosts, "slices": self.target.slices,
            "mesh": self.mesh, "layout": self.layout, "model": self.model, "config": self.config,
            "fits": self.fits, "ok": self.ok, "notes": self.notes,
            "per_device_bytes": {**{k: train.memory.get(k, 0) for k in ("arguments", "temporaries", "total")},
                                 "usable": self.usable, **train.memory, **self.state},
            "layers": [dataclasses.asdict(x) for x in train.layers],
            "collectives": train.collectives,
            "calls": [{k: v for k, v in dataclasses.asdict(c).items() if k != "executable"}
                      | {"fits": c.fits(self.usable, self.target.platform)} for c in self.calls],
        }


def _parser() -> Parser:
    p = Parser(prog=f"{program()} compile", description=(
        "Compile a config's train step and inference with the TPU or GPU compiler for a slice or node set, on this "
        "machine without the chip: memory per chip against its usable memory, the attention kernel per layer, the "
        "collectives, the compile time. docs/accelerators.md."),
        epilog="exit codes: 0 it fits and every promised kernel is in the program; 1 it does not fit, a kernel is "
        "missing, or the compiler refused it (one line says why); 2 bad input or no compiler installed (one line)")
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--target", required=True, metavar="T",
                   help="a TPU slice (v4-8, v5e-8, v5e-256, v5p-128, v6e-64, or a topology such as v5e:4x4) or a GPU "
                   "node set (h100-8, h200-8, a100-8, b200-8, h100-16)")
    p.add_argument("--slices", type=int, default=1, help="TPU slices joined over the data-center network (default 1)")
    p.add_argument("--layout", choices=list(shapes.LAYOUTS), default=None,
                   help="a mesh preset over the target's chips (default: the config's parallel.mesh): "
                   + "; ".join(f"{k}: {shapes.describe_layout(k)}" for k in shapes.LAYOUTS))
    p.add_argument("--fit", action="store_true",
                   help="search the largest per-chip batch that fits for each remat policy (model.remat none, dots, "
                   "full): one compile per probe")
    p.add_argument("--save", metavar="FILE", help="write the compiled train step to FILE (loading it needs the chip)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. train.batch_size=64")
    return p


def prepare(config_path: str, overrides: list[str], target: targets.Target, layout: str | None
            ) -> tuple[shapes.Resolved, list[Any]]:
    """The resolved config and the compile-only devices of its mesh (the first N of the target's)."""
    targets.check_compiler(target)
    devices = targets.devices(target)
    resolved = shapes.resolve(config_path, overrides, len(devices), layout, fixed_devices=True)
    return resolved, devices[: resolved.devices]


def compile_run(resolved: shapes.Resolved, devices: list[Any], target: targets.Target, config_path: str = "",
                calls: tuple[str, ...] = ("train", "eval"), keep: bool = False) -> Result:
    """Compile the steps of `resolved` on `devices` for `target` (the command but printing)."""
    import jax

    from train.devices.mesh import logical_rules, make_mesh
    from train.devices.steps import kernel_context, mesh_steps

    config = resolved.config
    mesh = make_mesh(config.parallel, devices)
    run = shapes.abstract(config, mesh)
    rules = logical_rules(config.parallel)
    strategy = config.parallel.context_strategy
    steps = mesh_steps(run.task, mesh, rules, strategy, jax.tree.leaves(run.state_sharding), target.platform)
    state = run.sharded_state()
    results = []
    for call in calls:
        batch, text = run.batches[call]
        args = (state, batch, run.rng(mesh)) if call == "train" else (state, batch)
        start = time.perf_counter()
        with programs.name_stacks():
            lowered = (steps.train if call == "train" else steps.eval).trace(*args).lower()
        try:
            executable = lowered.compile()
        except Exception as err:  # the compiler's refusal is the answer, in one line
            seconds = time.perf_counter() - start
            oom = targets.parse_oom(str(err))
            with kernel_context(mesh, rules, strategy, target.platform):
                layers = check_layers(config, call, batch["tokens"].shape[1], "segment_ids" in batch, None)
            memory = {"total": int(oom[0])} if oom else {}  # refused for want of memory: the compiler's figure
            results.append(Compiled(call, text, False, one_line_error(err), seconds, memory, layers, {}, None, []))
            continue
        seconds = time.perf_counter() - start
        hlo = executable.as_text() or ""
        with kernel_context(mesh, rules, strategy, target.platform):
            layers = check_layers(config, call, batch["tokens"].shape[1], "segment_ids" in batch, hlo)
        results.append(Compiled(call, text, True, None, seconds, _memory(executable), layers,
                                programs.collectives(hlo), _flops(executable), programs.largest_buffers(hlo),
                                executable=executable if keep else None))
    usable = targets.usable_bytes(target, devices[0])
    return Result(config_path, target, devices[0].device_kind, resolved.mesh_text(), resolved.layout,
                  describe_model(config, run.task.name), resolved.notes, usable,
                  state_memory(run.state, run.state_sharding, config.optim.freeze), results)


def _memory(executable: Any) -> dict[str, int]:
    """Bytes per chip from the compiler's memory analysis; `total` is its peak (arguments, outputs and
    temporaries live at once), or their sum where the compiler gives no peak."""
    m = executable.memory_analysis()
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "aliases": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
           "generated_code": int(m.generated_code_size_in_bytes)}
    peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    summed = out["arguments"] + out["outputs"] - out["aliases"] + out["temporaries"]
    out["total"] = peak if peak > 0 else summed
    return out


def _flops(executable: Any) -> float | None:
    try:
        cost = executable.cost_analysis()
    except Exception:  # a compiler without a cost model
        return None
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if isinstance(cost, dict) and "flops" in cost else None


def verdict(result: Result) -> str:
    """The result line: OK, or why not, with the levers that would fit."""
    from train.aot.report import size

    chip = result.target.generation
    if result.fits:
        missing = [f"{c.call} layers {', '.join(str(x.layer) for x in c.layers if not x.ok)}" for c in result.calls
                   if not c.kernels_ok]
        if missing:
            return ("result: FAILED: a promised attention kernel is missing from the compiled program "
                    f"({'; '.join(missing)})")
        peak = max(c.memory["total"] for c in result.calls)
        return (f"result: OK, fits: needs {size(peak)} per chip, a {chip} has {size(result.usable)} usable; every "
                "promised kernel is in the compiled program")
    failed = [c for c in result.calls if not c.compiled and not c.out_of_memory]
    if failed:
        return f"result: FAILED: the compiler refused the {failed[0].call} step: {failed[0].error}"
    worst = max((c for c in result.calls if not c.fits(result.usable, result.target.platform)),
                key=lambda c: c.memory["total"])
    at = f" (at {worst.largest_at} per chip, which compiles)" if worst.largest_at else ""
    largest = f"; largest buffers{at}: {', '.join(worst.largest)}" if worst.largest else ""
    return (f"result: DOES NOT FIT: the {worst.call} step needs {size(worst.memory['total'])} per chip, a {chip} has "
            f"{size(result.usable)} usable{largest}; to fit: {levers(result)}")


def name_buffers(result: Result, resolved: shapes.Resolved, devices: list[Any]) -> None:
    """For a train step the compiler refused for want of memory, which reports no buffers: compile it at a half
    or a quarter of its per-chip batch, the first that compiles, and name that program's largest buffers (none
    when even that is refused)."""
    refused = [c for c in result.calls if c.out_of_memory and c.call == "train"]  # the one training needs
    if result.state["parameters"] + result.state["optimizer_state"] >= result.usable:
        return  # the state alone is over the chip's memory: no batch compiles
    data_parallel = math.prod(n for axis, n in resolved.mesh.items() if axis in ("data", "fsdp"))
    per_chip = resolved.config.train.batch_size // data_parallel
    for call in refused:
        smaller = per_chip // 2
        while smaller >= max(1, per_chip // 4):
            config = resolved.config
            train = config.train.model_copy(update={"batch_size": smaller * data_parallel})
            probe = compile_run(dataclasses.replace(resolved, config=config.model_copy(update={"train": train})),
                                devices, result.target, calls=(call.call,))
            if probe.calls[0].compiled:
                call.largest, call.largest_at = probe.calls[0].largest, smaller
                break
            smaller //= 2


def levers(result: Result) -> str:
    """What would bring the step under the chip's memory, from this run's settings."""
    out = ["a smaller train.batch_size (python -m train compile --fit finds the largest)"]
    if "remat" not in result.model:
        out.append("model.remat=full (recompute each block in the backward pass)")
    if "fsdp" not in result.mesh and result.target.chips > 1:
        out.append("--layout fsdp (parameters, gradients and optimizer state split over the chips)")
    return ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    from train.aot import fit, render

    args = _parser().parse_intermixed_args(argv)
    target = targets.parse(args.target, args.slices)
    resolved, devices = prepare(args.config, args.overrides, target, args.layout)
    if args.fit:
        table = fit.search(resolved, devices, target, args.config, args.overrides)
        print(json.dumps(table.to_json(), indent=1) if args.json else fit.render(table))
        return OK_EXIT if table.any_fits else FAILED_EXIT
    result = compile_run(resolved, devices, target, args.config, keep=args.save is not None)
    name_buffers(result, resolved, devices)
    if args.save:
        render.save(result, args.save, args.config, args.overrides)
    print(json.dumps(result.to_json(), indent=1) if args.json else render.text(result))
    return OK_EXIT if result.ok else FAILED_EXIT


if __name__ == "__main__":
    sys.exit(main())
