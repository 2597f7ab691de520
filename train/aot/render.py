"""How `python -m train compile` prints its result, and writes the compiled train step (`--save`)."""

from __future__ import annotations

import json
import pickle
import platform
from importlib import metadata
from pathlib import Path
from typing import Any, cast

from train.aot import programs
from train.aot.report import LayerResult, counts_text, found_text, heading, layer_lines, size
from train.errors import ConfigError

SAVED_FORMAT = "jaxblock-compiled/1"


def text(result: Any) -> str:
    from train.aot.compiled import verdict

    target = result.target
    lines = heading(f"{result.config or 'config'} compiled for {target.describe_chips(result.chip)}: {result.mesh}",
                    result.layout, result.model, result.notes)
    for call in result.calls:
        title = "train step" if call.call == "train" else "inference (eval step, train=False)"
        lines.append("")
        if not call.compiled:
            lines.append(f"{title}: {call.shapes}; NOT compiled ({call.seconds:.1f}s): {call.error}")
            if call.largest:
                lines.append(f"  largest buffers (the compiler's memory report): {'; '.join(call.largest)}")
            continue
        flops = f", {_flops(call.flops)} per chip" if call.flops else ""
        lines.append(f"{title}: {call.shapes}; compiled in {call.seconds:.1f}s{flops}")
        m = call.memory
        fits = call.fits(result.usable, target.platform)
        over = " (the compiler accepts it: XLA's peak is an estimate)" if fits and m["total"] > result.usable else ""
        lines += [f"  memory per chip (the compiler's): arguments {size(m['arguments'])}, outputs "
                  f"{size(m['outputs'] - m['aliases'])} (+{size(m['aliases'])} in place of their arguments), "
                  f"temporaries {size(m['temporaries'])}",
                  f"  peak {size(m['total'])} of {size(result.usable)} usable: "
                  f"{'fits' if fits else 'DOES NOT FIT'}{over}"]
        if "live_at_peak" in m:
            lines.append(f"  live at once at most (the compiler's live ranges, arguments in use included): "
                         f"{size(m['live_at_peak'])}")
        if call.largest:
            lines.append(f"  largest buffers (the compiler's memory report): {'; '.join(call.largest)}")
        lines += layer_lines(call.layers, _status)
        lines.append(f"  collectives: {counts_text(call.collectives)}")
    s = result.state
    lines += ["", f"state per chip (from the shardings, part of the arguments): parameters {size(s['parameters'])}, "
                  f"optimizer state {size(s['optimizer_state'])}; gradients {size(s['gradients'])} (temporaries)",
              "", verdict(result)]
    return "\n".join(lines)


def _flops(flops: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f} FLOP"


def _status(layer: LayerResult) -> str:
    if programs.KERNEL_TARGETS.get(layer.kernel) is None:
        return f"plain XLA: {found_text(layer)}"
    return f"{'compiled' if layer.ok else 'MISSING from the compiled program'}: {found_text(layer)}"


def save(result: Any, path: str, config_path: str, overrides: list[str]) -> None:
    """The compiled train step and what loading it needs: the same jax, jaxlib and compiler, and the chips.

    The step's own argument structure holds the optimizer (a static field of the train state), which does not
    pickle, so the file keeps the flat calling convention: `serialize_executable.deserialize_and_load(
    saved['executable'], saved['in_tree'], saved['out_tree'])` on a host of that slice gives a function of
    `*jax.tree.leaves(args)` (the train state, batch and key, as `python -m train` builds them) that returns
    the flat outputs: `jax.tree.unflatten` them with the structure of (state, metrics)."""
    import jax
    from jax.experimental import serialize_executable

    train = next((c for c in result.calls if c.call == "train"), None)
    if train is None or train.executable is None:
        raise ConfigError("--save: the train step did not compile, so there is nothing to save")
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(train.executable)
    except Exception as err:  # an executable holding objects that do not pickle (cuDNN's partitioning rule)
        raise ConfigError(f"--save: the compiled train step cannot be serialized ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:120]}): compile it on the chip instead") from None
    n_in, n_out = cast(Any, in_tree).num_leaves, cast(Any, out_tree).num_leaves
    in_tree, out_tree = jax.tree.structure(((0,) * n_in, {})), jax.tree.structure([0] * n_out)
    versions = {name: _version(name) for name in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "flax")}
    header = {"format": SAVED_FORMAT, "target": result.target.name, "chip": result.chip, "chips": result.target.chips,
              "hosts": result.target.hosts, "mesh": result.mesh, "config": config_path, "overrides": overrides,
              "versions": {k: v for k, v in versions.items() if v}, "python": platform.python_version(),
              "arguments": n_in, "outputs": n_out,
              "load": "jax.experimental.serialize_executable.deserialize_and_load(executable, in_tree, out_tree) "
                      "on a host of this target, with these versions; call it with the flat leaves of "
                      "(state, batch, key) and unflatten its outputs as (state, metrics)"}
    try:
        with open(path, "wb") as f:
            pickle.dump({"header": header, "executable": payload, "in_tree": in_tree, "out_tree": out_tree}, f)
    except OSError as err:
        raise ConfigError(f"--save {path}: cannot write it ({err.strerror}): pass a writable path") from None
    Path(path + ".json").write_text(json.dumps(header, indent=1) + "\n")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
