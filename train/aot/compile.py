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

import json
import sys

from train.aot import fit, render, shapes, targets
from train.aot.compiled import compile_run, prepare
from train.cli import Parser, program
from train.errors import FAILED_EXIT, OK_EXIT


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
                   "full; a model.remat=P override searches P only): one compile per probe")
    p.add_argument("--save", metavar="FILE", help="write the compiled train step to FILE (loading it needs the chip)")
    p.add_argument("--dump", metavar="DIR", help="keep the compiler's optimized program and its buffer assignment "
                   "(the memory usage report, every buffer's live range) of each step in DIR/train and DIR/eval")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. train.batch_size=64")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_intermixed_args(argv)
    if args.fit and (args.dump or args.save):
        parser.error("--fit compiles many programs: --dump and --save go with a single compile (drop --fit, set "
                     "train.batch_size and model.remat to the row you want)")
    target = targets.parse(args.target, args.slices)
    resolved, devices = prepare(args.config, args.overrides, target, args.layout)
    if args.fit:
        table = fit.search(resolved, devices, target, args.config, args.overrides)
        print(json.dumps(table.to_json(), indent=1) if args.json else fit.render(table))
        return OK_EXIT if table.any_fits else FAILED_EXIT
    result = compile_run(resolved, devices, target, args.config, keep=args.save is not None, dump=args.dump)
    if args.save:
        render.save(result, args.save, args.config, args.overrides)
    print(json.dumps(result.to_json(), indent=1) if args.json else render.text(result))
    return OK_EXIT if result.ok else FAILED_EXIT


if __name__ == "__main__":
    sys.exit(main())
