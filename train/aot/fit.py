"""`python -m train compile --fit`: the largest per-chip batch that fits, for each rematerialization policy.

For each of model.remat none, dots (keep the matmuls' outputs, recompute the rest) and full (keep each block's
input only), the train step is compiled at growing per-chip batches, doubling from the config's until one
does not fit, then bisecting: each probe one compile, judged by the compiler's peak memory against the chip's
usable memory (train/aot/targets.py). The table gives, per policy, the largest per-chip batch, its global
batch, its peak memory and FLOPs per chip where the compiler counts them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from train.aot import shapes, targets
from train.aot.report import size

POLICIES = ("none", "dots", "full")
LIMIT = 4096  # the largest per-chip batch tried


@dataclasses.dataclass
class Probe:
    per_chip: int
    fits: bool
    total: int | None  # peak bytes per chip (None: the compiler refused the program)
    flops: float | None
    seconds: float


@dataclasses.dataclass
class Row:
    remat: str
    largest: int  # per chip; 0 when not even one row fits
    global_batch: int
    total: int | None
    flops: float | None
    probes: list[Probe]


@dataclasses.dataclass
class Table:
    config: str
    target: str
    chip: str
    usable: int
    data_parallel: int
    model: str
    rows: list[Row]

    @property
    def any_fits(self) -> bool:
        return any(row.largest > 0 for row in self.rows)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"any_fits": self.any_fits}


def search(resolved: shapes.Resolved, devices: list[Any], target: targets.Target, config_path: str,
           overrides: list[str]) -> Table:
    from train.aot.compiled import compile_run

    config = resolved.config
    data_parallel = math.prod(n for axis, n in resolved.mesh.items() if axis in ("data", "fsdp"))
    start = max(1, config.train.batch_size // data_parallel)
    rows, usable, chip, model = [], 0, "", ""
    for policy in POLICIES:
        probes: dict[int, Probe] = {}
        model_cfg = config.model.model_copy(update={"remat": policy})

        def probe(per_chip: int, model_cfg: Any = model_cfg, probes: dict[int, Probe] = probes) -> Probe:
            nonlocal usable, chip, model
            if per_chip not in probes:
                train = config.train.model_copy(update={"batch_size": per_chip * data_parallel})
                changed = dataclasses.replace(resolved, config=config.model_copy(update={"model": model_cfg,
                                                                                          "train": train}))
                result = compile_run(changed, devices, target, config_path, calls=("train",))
                usable, chip, model = result.usable, result.chip, result.model.replace(f", remat {policy}", "")
                call = result.calls[0]
                total = call.memory.get("total")
                probes[per_chip] = Probe(per_chip, call.fits(usable, target.platform), total, call.flops,
                                         call.seconds)
            return probes[per_chip]

        best = _largest(probe, start)
        fitting = probes.get(best)
        rows.append(Row(policy, best, best * data_parallel, fitting.total if fitting else None,
                        fitting.flops if fitting else None, sorted(probes.values(), key=lambda p: p.per_chip)))
    return Table(config_path, target.name, chip, usable, data_parallel, model, rows)


def _largest(probe: Any, start: int) -> int:
    """The largest n in [1, LIMIT] with probe(n).fits, assuming fitting is monotone in n: double (or halve)
    from `start` to bracket it, then bisect."""
    n = min(start, LIMIT)
    if probe(n).fits:
        low = n
        high = None
        while high is None and low < LIMIT:
            trial = min(low * 2, LIMIT)
            if probe(trial).fits:
                low = trial
            else:
                high = trial
        if high is None:
            return low
    else:
        high = n
        low = 0
        while high > 1:
            trial = high // 2
            if probe(trial).fits:
                low = trial
                break
            high = trial
        if low == 0:
            return 0
    while high - low > 1:
        mid = (low + high) // 2
        if probe(mid).fits:
            low = mid
        else:
            high = mid
    return low


def render(table: Table) -> str:
    lines = [f"{table.config} on {table.target} ({table.chip}, {size(table.usable)} usable per chip), "
             f"{table.data_parallel} chips share each batch: the largest per-chip batch that fits",
             f"model: {table.model}", "",
             "| remat | per chip | global batch | peak per chip | TFLOP per chip | compiles |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in table.rows:
        peak = size(row.total) if row.total else "-"
        flops = f"{row.flops / 1e12:.2f}" if row.flops else "-"
        seconds = sum(p.seconds for p in row.probes)
        lines.append(f"| {row.remat} | {row.largest or 'none fits'} | {row.global_batch or '-'} | {peak} | {flops} | "
                     f"{len(row.probes)} ({seconds:.0f}s) |")
    lines += ["", "probes (per chip: peak): " + "; ".join(
        f"{row.remat} " + ", ".join(f"{p.per_chip}: {size(p.total) if p.total else 'refused'}"
                                    f"{'' if p.fits else ' (no)'}" for p in row.probes) for row in table.rows)]
    return "\n".join(lines)
