"""`python -m train verify --workdir W [--json]`: read every checkpoint of a workdir back, write nothing.

What an operator runs before trusting a workdir copied between machines. For each committed step it
restores every item the way a resume does, onto this machine's first device: the parameters, the
optimizer state and step counter, and the metadata (seed, label names, input-stream position), each array
read in full, so a truncated or missing array file, a metadata file that is not JSON or a missing item is
found. It also checks the parameter shapes against the run's config.yaml (a checkpoint that restores but
belongs to another model is not one a resume can use). Damage is named the way a training run names it
(train/checkpoints/repair.py `describe_damage`), with nothing moved: the next training run on the
workdir moves damaged steps aside and resumes from the newest good one. Unfinished saves (Orbax's
`<step>.orbax-checkpoint-tmp-*`, never used) and steps already moved to `checkpoints.damaged/` are listed.

One line per step, e.g.
    checkpoint 30: ok (params 12 arrays, optimizer 38 arrays, step 30)
    checkpoint 40: damaged (params/encoder.embedding/0.0: Requested byte range [0, 7596) is not valid ...)
then a summary line. Exit codes: 0 every checkpoint restores; 1 at least one does not; 2 bad input (no
such workdir, no checkpoint in it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

USAGE_EXIT, DAMAGED_EXIT = 2, 1


def _parser() -> argparse.ArgumentParser:
    from train.cli import Parser, program

    p = Parser(prog=f"{program()} verify",
               description="Read every checkpoint of a workdir back and report, per step, whether it restores "
                           "(nothing is moved or written).")
    p.add_argument("--workdir", required=True, help="a run directory (e.g. one copied from another machine)")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint instead of a line")
    return p


def verify_step(manager: Any, workdir: Path, step: int, config: Any) -> dict[str, Any]:
    """{"step", "ok", "damage" (one line or None), "arrays" {item: count}, "saved_step"} for one step."""
    import jax
    import orbax.checkpoint as ocp

    from train.checkpoints.repair import describe_damage, quiet_stderr
    from train.checkpoints.store import CheckpointError, check_compatible

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def abstract(tree: Any) -> Any:
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device),
                            getattr(tree, "tree", tree))

    step_dir = Path(str(manager.directory)) / str(step)
    result: dict[str, Any] = {"step": step, "ok": False, "damage": None, "arrays": {}, "saved_step": None}
    with quiet_stderr():
        try:
            if config is not None:
                check_compatible(workdir, step, _param_shapes(config))
            metadata = manager.item_metadata(step)
            targets = {}
            for item in ("params", "train"):  # (a JSON item has no array metadata: its restore reads it)
                try:
                    targets[item] = abstract(metadata[item])
                except (KeyError, TypeError, AttributeError):
                    raise KeyError(f'Item "{item}" was not found in the checkpoint') from None
            restored = manager.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(targets["params"]),
                train=ocp.args.StandardRestore(targets["train"]),
                meta=ocp.args.JsonRestore()))
            jax.block_until_ready((restored["params"], restored["train"]))
        except CheckpointError as err:
            reason = describe_damage(err, step_dir)
            result["damage"] = reason or f"does not match the run's config.yaml: {err}"
            return result
        except Exception as err:  # what is not damage is still a checkpoint that does not restore
            reason = describe_damage(err, step_dir)
            result["damage"] = reason or f"does not restore ({err.__class__.__name__}: {str(err).splitlines()[0]})"
            return result
    result["arrays"] = {item: len(jax.tree.leaves(restored[item])) for item in ("params", "train")}
    saved = restored["meta"].get("step") if isinstance(restored["meta"], dict) else None
    result["saved_step"] = saved
    if saved is not None and int(saved) != step:
        result["damage"] = f"meta says step {saved}: the directory was renamed or mixed with another run's"
        return result
    result["ok"] = True
    return result


def _param_shapes(config: Any) -> Any:
    from train.loop.state import abstract_init
    from train.tasks import task_for

    model = task_for(config).build_model(config.model)
    return abstract_init(model, config.data.buckets[-1])[0]


def _line(r: dict[str, Any]) -> str:
    if r["ok"]:
        return (f"checkpoint {r['step']}: ok (params {r['arrays']['params']} arrays, optimizer and step "
                f"{r['arrays']['train']} arrays, step {r['saved_step']})")
    return f"checkpoint {r['step']}: damaged ({r['damage']})"


def main(argv: list[str]) -> int:
    from train.checkpoints.repair import DAMAGED_SUFFIX, committed_steps
    from train.checkpoints.store import CHECKPOINT_DIR, CONFIG_FILE, CheckpointError, read_only_manager, read_run_config
    from train.cli import one_line

    args = _parser().parse_args(argv)
    workdir = Path(args.workdir)
    if not workdir.is_dir():
        raise CheckpointError(f"workdir {workdir} does not exist: pass the --workdir of a run")
    directory = (workdir / CHECKPOINT_DIR).absolute()
    steps = committed_steps(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint in {workdir} ({CHECKPOINT_DIR}/ is missing or empty): pass the "
                              "--workdir of a run that saved one")
    config = read_run_config(workdir) if (workdir / CONFIG_FILE).is_file() else None
    results = []
    with read_only_manager(directory) as manager:
        for step in steps:
            results.append(verify_step(manager, workdir, step, config))
            r = results[-1]
            print(json.dumps(r) if args.json else one_line(_line(r)), flush=True)
    unfinished = sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.isdigit())
    moved = directory.parent / (directory.name + DAMAGED_SUFFIX)
    damaged = [r["step"] for r in results if not r["ok"]]
    if not args.json:
        extra = ""
        if unfinished:
            extra += f"; {len(unfinished)} unfinished save(s) never used ({', '.join(unfinished)})"
        if moved.is_dir() and any(moved.iterdir()):
            extra += f"; {len(list(moved.iterdir()))} moved aside earlier in {moved.name}/"
        if config is None:
            extra += f"; no {CONFIG_FILE}, so shapes were not checked against a config"
        if damaged:
            good = [r["step"] for r in results if r["ok"]]
            resume = f"a training run resumes from {good[-1]}" if good else "no checkpoint restores"
            print(one_line(f"{len(damaged)} of {len(results)} checkpoints damaged ({', '.join(map(str, damaged))}); "
                           f"{resume} and moves the damaged ones aside{extra}"))
        else:
            print(one_line(f"all {len(results)} checkpoints restore{extra}"))
    sys.stdout.flush()
    return DAMAGED_EXIT if damaged else 0
