"""Where an export's parameters should live: inside the StableHLO (constants) or in safetensors beside it.

    python -m bench.export_params --model hf:all-MiniLM-L6-v2 [--rounds 3]
    python -m bench.export_params --workdir runs/sentiment_pretrained

Exports the same model both ways (train/export.py, --params artifact and --params safetensors) into a
temporary directory, then, in a fresh process per measurement and alternating the two, loads it the way a
model-code-free loader does (jax, flatbuffers, numpy and tokenizers only; safetensors parsed with numpy) and
times: reading and deserializing (plus reading the weights and placing them on the device), the first call at
each of SHAPES (each compiles), then a steady call (the mean of 5) at the last shape. It reports the files'
sizes, the medians, and the process's peak resident memory after the compiles. The choice it informs is
written in docs/serving.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = [(1, 16), (8, 32), (32, 32), (32, 64)]

# Runs in a fresh interpreter: only jax, numpy and json, as a model-code-free loader.
_LOADER = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import jax, numpy as np
d, shapes = sys.argv[1], json.loads(sys.argv[2])
manifest = json.load(open(f"{d}/manifest.json"))
t1 = time.perf_counter()
model = jax.export.deserialize(open(f"{d}/model.jax", "rb").read())
args = []
if manifest["params"]["in"] != "model.jax":
    raw = open(f"{d}/params.safetensors", "rb").read()
    args = [jax.device_put([np.frombuffer(raw, t, n, o).reshape(s) for t, s, o, n in manifest["params"]["layout"]])]
    jax.block_until_ready(args)
t2 = time.perf_counter()
call = jax.jit(model.call)  # as the server calls it
first = []
for b, l in shapes:
    x = np.ones((b, l), np.int32)
    s = time.perf_counter()
    jax.block_until_ready(call(*args, x, x))
    first.append(time.perf_counter() - s)
b, l = shapes[-1]
x = np.ones((b, l), np.int32)
s = time.perf_counter()
for _ in range(5):
    jax.block_until_ready(call(*args, x, x))
steady = (time.perf_counter() - s) / 5
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first_calls": first, "steady": steady,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _export(args: argparse.Namespace, out: Path, params: str) -> None:
    where = ["--workdir", args.workdir] if args.workdir else ["--model", args.model]
    cmd = [sys.executable, "-m", "train", "export", *where, "--out", str(out), "--params", params,
           "--platforms", args.platforms]
    subprocess.run(cmd, check=True)


def _load(directory: Path) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _LOADER, str(directory), json.dumps(SHAPES)], check=True,
                          capture_output=True, text=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export_params", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="hf:all-MiniLM-L6-v2", help="a pretrained checkpoint (hf:...)")
    parser.add_argument("--workdir", help="a trained run instead of --model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--platforms", default="cpu,cuda,tpu")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {kind: Path(tmp) / kind for kind in ("artifact", "safetensors")}
        for kind, directory in dirs.items():
            _export(args, directory, kind)
        runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in dirs}
        for _ in range(args.rounds):
            for kind, directory in dirs.items():
                runs[kind].append(_load(directory))
        print(f"{'params in':<12} {'files MiB':>9} {'load s':>7} {'first call s (per shape ' + str(SHAPES) + ')':<60} "
              f"{'steady ms':>9} {'peak RSS MiB':>12}")
        for kind, directory in dirs.items():
            size = sum(p.stat().st_size for p in directory.iterdir()) / 2**20
            med = {k: statistics.median(r[k] for r in runs[kind]) for k in ("load", "steady", "peak_rss_mib")}
            firsts = [statistics.median(r["first_calls"][i] for r in runs[kind]) for i in range(len(SHAPES))]
            shown = " ".join(f"{f:.2f}" for f in firsts)
            print(f"{kind:<12} {size:>9.1f} {med['load']:>7.2f} {shown:<60} {med['steady'] * 1e3:>9.1f} "
                  f"{med['peak_rss_mib']:>12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
