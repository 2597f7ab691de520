"""Stress of the two faults whose outcome depends on timing: a damaged newest checkpoint, and kill -9 at a
random moment. Each repetition reruns the real command and counts what it printed that is not one of
the command's own lines (tracebacks, warnings, library noise, anything after the last line), the
training steps missing from or repeated in metrics.jsonl, and whether the final parameters are bitwise
those of an uninterrupted run.

    python tests/faults/stress.py --damaged 20 --kill9 20 --out /tmp/stress   # prints the counts (JSON)

tests/faults/test_stress.py runs a few repetitions of each (slow); the fault catalogue uses `foreign_lines`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: this checkout's `train`, for reading the checkpoints back
    sys.path.insert(0, str(ROOT))
TINY = str(ROOT / "configs/tiny.yaml")
ARGS = ("parallel.strategy=single", "train.progress=false", "train.steps=20", "checkpoint.every=5",
        "checkpoint.max_to_keep=10", "train.log_every=1", "train.eval_every=5")

# Every line a command of this repository prints on stderr starts like one of these.
_OWN = re.compile(
    r"^(data: |step \d+: |checkpoint \d+ is damaged |resuming from step \d+ |SIG(INT|TERM)( again)?: "
    r"|interrupted during |error: |note: |stopped by signal at step )"
)
DAMAGE_KINDS = ("truncate_array_file", "delete_array_file", "bad_metadata_json", "delete_item")


def foreign_lines(err: str) -> list[str]:
    """The lines of a whole stderr that are not the command's own: a traceback, a warning, library noise,
    whatever a thread or the interpreter's exit printed after the last own line."""
    return [line for line in err.splitlines() if line.strip() and not _OWN.match(line)]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")]))
    return out


def cli(workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "--config", TINY, "--workdir", str(workdir), *ARGS, *extra]


def train(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cli(workdir), env=env(), cwd=ROOT, capture_output=True, text=True, timeout=900)


def damage(step_dir: Path, kind: str) -> None:
    """Damage checkpoint `step_dir` the way a full disk, a bad copy or a filesystem repair leaves it."""
    if kind == "truncate_array_file":
        os.truncate(array_file_it_reads(step_dir / "params"), 10)
    elif kind == "delete_array_file":
        array_file_it_reads(step_dir / "params").unlink()
    elif kind == "bad_metadata_json":
        (step_dir / "params" / "_METADATA").write_text('{"tree_metadata": ')
    elif kind == "delete_item":
        shutil.rmtree(step_dir / "params")
    else:
        raise ValueError(kind)


def array_file_it_reads(item_dir: Path) -> Path:
    """The largest data file of an OCDBT checkpoint item (`<step>/params`, `<step>/train`) that reading the
    item back needs. Most files under its `d/` folders are B-tree nodes that later writes of the same save
    superseded: damaging one of those leaves the checkpoint whole, and which file is largest depends on
    how the save's writes were batched, so the plain largest file is sometimes one nothing reads."""
    files = sorted((p for p in item_dir.rglob("*") if p.is_file() and p.parent.name == "d"),
                   key=lambda p: p.stat().st_size, reverse=True)
    for path in files:
        content = path.read_bytes()
        os.truncate(path, 10)
        try:
            needed = not _reads_back(item_dir)
        finally:
            path.write_bytes(content)
        if needed:
            return path
    raise ValueError(f"no data file of {item_dir} is needed to read it back")


def _reads_back(item_dir: Path) -> bool:
    """Whether every key of the item's OCDBT store reads (a fresh TensorStore context: nothing cached)."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir.absolute()}/"}, context=ts.Context()).result()
    try:
        for key in kv.list().result():
            kv.read(key).result()
    except ValueError:  # OUT_OF_RANGE, DATA_LOSS: the file was cut
        return False
    return True


def steps_logged(workdir: Path) -> list[int]:
    if not (workdir / "metrics.jsonl").is_file():  # the run failed before its first row (see its exit code)
        return []
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in rows if r["split"] == "train"]


def params_equal(a: Path, b: Path) -> bool:
    from train.checkpoints.store import CheckpointError

    try:
        return _params_equal(a, b)
    except CheckpointError:  # no checkpoint to compare: counted as not equal
        return False


def _params_equal(a: Path, b: Path) -> bool:
    import jax
    import numpy as np

    from train.checkpoints.restore import restore_run
    from train.checkpoints.store import latest_step

    x, y = (jax.tree.leaves(restore_run(w, latest_step(w)).params) for w in (a, b))
    return len(x) == len(y) and all(np.array_equal(np.asarray(p), np.asarray(q)) for p, q in zip(x, y, strict=True))


def judge(workdir: Path, reference: Path, errs: list[str], codes: list[int]) -> dict[str, Any]:
    steps = steps_logged(workdir)
    want = list(range(1, 21))
    return {"exit_codes": codes, "foreign_lines": sum(len(foreign_lines(e)) for e in errs),
            "tracebacks": sum(e.count("Traceback") for e in errs),
            "lost_steps": len(set(want) - set(steps)), "repeated_steps": len(steps) - len(set(steps)),
            "bitwise_equal": params_equal(workdir, reference),
            "first_foreign": next((line for e in errs for line in foreign_lines(e)), None)}


def damaged_resume(reference: Path, workdir: Path, kind: str) -> dict[str, Any]:
    """A copy of the finished run with checkpoint 20 damaged, resumed by the same command."""
    shutil.copytree(reference, workdir)
    damage(workdir / "checkpoints" / "20", kind)
    done = train(workdir)
    result = judge(workdir, reference, [done.stderr], [done.returncode])
    result.update(kind=kind, moved_aside=len(list((workdir / "checkpoints.damaged").iterdir())),
                  resumed_from_15="resuming from 15" in done.stderr)
    return result


def killed_and_rerun(reference: Path, workdir: Path, after_s: float) -> dict[str, Any]:
    """The run killed with SIGKILL `after_s` seconds after it started, then rerun to the end."""
    proc = subprocess.Popen(cli(workdir), env=env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(after_s)
    killed = proc.poll() is None
    proc.kill()
    proc.wait()
    done = train(workdir)
    result = judge(workdir, reference, [done.stderr], [done.returncode])
    result.update(after_s=round(after_s, 2), killed_while_running=killed)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--damaged", type=int, default=20)
    p.add_argument("--kill9", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-kill-s", type=float, help="latest kill moment (default: the reference run's duration; "
                   "lower it when the machine got faster since, so that the kills land while the run trains)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    reference = args.out / "reference"
    if not (reference / "summary.json").is_file():
        shutil.rmtree(reference, ignore_errors=True)
        start = time.monotonic()
        whole = train(reference)
        assert whole.returncode == 0, whole.stderr
        run_s = time.monotonic() - start
    else:
        run_s = 20.0
    results: dict[str, list[dict[str, Any]]] = {"damaged": [], "kill9": []}
    for i in range(args.damaged):
        kind = DAMAGE_KINDS[i % len(DAMAGE_KINDS)]
        results["damaged"].append(damaged_resume(reference, args.out / f"damaged-{i}", kind))
        print(json.dumps(results["damaged"][-1]), flush=True)
    for i in range(args.kill9):
        after = rng.uniform(1.0, args.max_kill_s or run_s)
        results["kill9"].append(killed_and_rerun(reference, args.out / f"kill9-{i}", after))
        print(json.dumps(results["kill9"][-1]), flush=True)
    counted = ("foreign_lines", "tracebacks", "lost_steps", "repeated_steps")
    totals = {name: {"runs": len(rs), "nonzero_exits": sum(any(r["exit_codes"]) for r in rs),
                     **{key: sum(r[key] for r in rs) for key in counted},
                     "not_bitwise_equal": sum(not r["bitwise_equal"] for r in rs)} for name, rs in results.items()}
    print(json.dumps({"totals": totals}))
    return 0 if all(not any(v for k, v in t.items() if k != "runs") for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
