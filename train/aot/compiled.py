"""A config's train and eval steps compiled for a target's compile-only devices: what `python -m train
compile` reports (train/aot/compile.py has the command; render.py prints it; fit.py searches batches).

`compile_run` builds the steps with the step builder training uses (train/devices/steps.py) on a mesh of the
target's devices, with the attention kernels chosen for the target, and compiles each; `Compiled` holds one
call's memory per chip (the compiler's analysis), kernels per layer, collectives, FLOPs and largest buffers;
`Result` the whole answer, `verdict` its one result line.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from train.aot import programs, shapes, targets
from train.aot.report import LayerResult, check_layers, describe_model, one_line_error, state_memory

REMAT_POLICIES = ("none", "dots", "full")


@dataclasses.dataclass
class Compiled:
    """One call (train or eval) compiled for the target."""

    call: str
    shapes: str
    compiled: bool
    error: str | None
    seconds: float
    memory: dict[str, int]  # bytes per chip: arguments, outputs, aliases, temporaries, generated_code, total,
    # and live_at_peak where the compiler's live ranges give it
    layers: list[LayerResult]
    collectives: dict[str, int]
    flops: float | None
    largest: list[str]  # the largest buffers of the compiler's memory report, described
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
                                 "usable": self.usable, **train.memory,
                                 **{k: self.state[k] for k in ("parameters", "gradients", "optimizer_state")}},
            "layers": [dataclasses.asdict(x) for x in train.layers],
            "collectives": train.collectives,
            "calls": [{k: v for k, v in dataclasses.asdict(c).items() if k != "executable"}
                      | {"fits": c.fits(self.usable, self.target.platform)} for c in self.calls],
        }


def prepare(config_path: str, overrides: list[str], target: targets.Target, layout: str | None
            ) -> tuple[shapes.Resolved, list[Any]]:
    """The resolved config and the compile-only devices of its mesh (the first N of the target's)."""
    targets.check_compiler(target)
    devices = targets.devices(target)
    resolved = shapes.resolve(config_path, overrides, len(devices), layout, fixed_devices=True)
    return resolved, devices[: resolved.devices]


def compile_run(resolved: shapes.Resolved, devices: list[Any], target: targets.Target, config_path: str = "",
                calls: tuple[str, ...] = ("train", "eval"), keep: bool = False, dump: str | None = None) -> Result:
    """Compile the steps of `resolved` on `devices` for `target` (the command but printing); `dump`: a
    directory to keep the compiler's optimized program and buffer assignment of each step in (DUMP/train,
    DUMP/eval)."""
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
        with programs.memory_report(None if dump is None else os.path.join(dump, call)) as report:
            try:
                executable = lowered.compile(compiler_options=report.options)
            except Exception as err:  # the compiler's refusal is the answer, in one line
                seconds = time.perf_counter() - start
                oom = targets.parse_oom(str(err))
                with kernel_context(mesh, rules, strategy, target.platform):
                    layers = check_layers(config, call, batch["tokens"].shape[1], "segment_ids" in batch, None)
                memory = {"total": int(oom[0])} if oom else {}  # refused for want of memory: the compiler's figure
                results.append(Compiled(call, text, False, one_line_error(err), seconds, memory, layers, {}, None,
                                        report.largest()))
                continue
            largest, live = report.largest(), report.live_at_peak()
        seconds = time.perf_counter() - start
        hlo = executable.as_text() or ""
        with kernel_context(mesh, rules, strategy, target.platform):
            layers = check_layers(config, call, batch["tokens"].shape[1], "segment_ids" in batch, hlo)
        memory = _memory(executable) | ({"live_at_peak": live} if live is not None else {})
        results.append(Compiled(call, text, True, None, seconds, memory, layers,
                                programs.collectives(hlo), _flops(executable), largest,
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
    largest = f"; largest buffers: {', '.join(worst.largest)}" if worst.largest else ""
    return (f"result: DOES NOT FIT: the {worst.call} step needs {size(worst.memory['total'])} per chip, a {chip} has "
            f"{size(result.usable)} usable{largest}; to fit: {levers(result)}")


def levers(result: Result) -> str:
    """What would bring the step under the chip's memory, from this run's settings."""
    out = ["a smaller train.batch_size (python -m train compile --fit finds the largest)"]
    if "remat" not in result.model:
        out.append("model.remat=full (recompute each block in the backward pass)")
    if "fsdp" not in result.mesh and result.target.chips > 1:
        out.append("--layout fsdp (parameters, gradients and optimizer state split over the chips)")
    if result.model.startswith("mlm,") and "loss in" not in result.model:
        out.append("mlm.loss_chunks=8 (the head's loss in groups of slots: its float32 logits not kept for the "
                   "backward pass)")
    return ", ".join(out)


