"""`python -m train compile --fit`: the largest per-chip batch that fits, for each rematerialization policy.

For each of model.remat none, dots (keep the matmuls' outputs, recompute the rest) and full (keep each block's
input only), or for the one a `model.remat=` override names, the train step is compiled at several per-chip
batches, each probe one compile judged by the compiler's peak memory against the chip's usable memory
(train/aot/targets.py). A step's peak is close to a line in the batch (the state, plus so much a row), and the
compiler gives its figure also for a program it refuses, so after two probes the search aims at where the line
crosses the usable memory, then checks that batch and the next one: the answer is exact, usually in 3-5
compiles where doubling and bisecting took ~10 (a BERT-base step compiles in minutes on a CPU host). Where the
line misleads it, as near the chip's limit where the compiler recomputes to fit and the peaks sit against the
limit, it bisects the bracket it has. The table gives, per policy, the largest per-chip batch, its
global batch, its peak memory and FLOPs per chip where the compiler counts them. Each probe prints one line on
stderr as it ends.
"""

from __future__ import annotations

import dataclasses
import math
import sys
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

    @property
    def at_limit(self) -> bool:
        """The search's largest batch fits: the largest that fits is at least that, not that."""
        return self.largest >= LIMIT

    def shown(self) -> str:
        if not self.largest:
            return "none fits"
        return f"{self.largest}+ (the search's limit)" if self.at_limit else str(self.largest)


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
        out = dataclasses.asdict(self) | {"any_fits": self.any_fits, "limit": LIMIT}
        for row, data in zip(self.rows, out["rows"], strict=True):
            data["at_limit"] = row.at_limit
        return out


def search(resolved: shapes.Resolved, devices: list[Any], target: targets.Target, config_path: str,
           overrides: list[str]) -> Table:
    from train.aot.compiled import compile_run

    config = resolved.config
    data_parallel = math.prod(n for axis, n in resolved.mesh.items() if axis in ("data", "fsdp"))
    start = max(1, config.train.batch_size // data_parallel)
    rows, usable, chip, model = [], 0, "", ""
    pinned = any(o.split("=", 1)[0].strip() == "model.remat" for o in overrides)
    for policy in (config.model.remat,) if pinned else POLICIES:
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
                peak = f"peak {size(total)}" if total else "refused"
                verdict = "fits" if probes[per_chip].fits else "does not fit"
                print(f"fit: remat {policy}, {per_chip} a chip: {peak}, {verdict} (compiled in {call.seconds:.0f}s)",
                      file=sys.stderr, flush=True)  # a probe is minutes for a big model: show each
            return probes[per_chip]

        best = _largest(probe, start, lambda: usable)
        fitting = probes.get(best)
        rows.append(Row(policy, best, best * data_parallel, fitting.total if fitting else None,
                        fitting.flops if fitting else None, sorted(probes.values(), key=lambda p: p.per_chip)))
    return Table(config_path, target.name, chip, usable, data_parallel, model, rows)


def _largest(probe: Any, start: int, usable: Any = None) -> int:
    """The largest n in [1, LIMIT] with probe(n).fits, assuming fitting is monotone in n.

    `usable()` gives the chip's usable bytes (known after the first probe). Once two probes have the
    compiler's peak, the next trial is where the line through them reaches it, kept inside the bracket; with
    fewer, or when two aimed trials running have not halved the bracket (three while none failed), it
    doubles, halves or bisects, so a peak far from a line costs at most about three times bisection's.
    Near the chip's limit the compiler recomputes to fit, and the peaks either side of the edge sit against
    the limit, off any line: a line that says a batch that failed fits, or a second batch fitting past the
    line's edge (after the one check of the batch next to it), makes the next trial a bisection."""
    low, high = 0, LIMIT + 1  # the largest n known to fit, the smallest known not to
    seen: dict[int, Probe] = {}
    trial, aimed, before, checked = min(max(start, 1), LIMIT), 0, LIMIT + 1, False
    while True:
        seen[trial] = probe(trial)
        low, high = (trial, high) if seen[trial].fits else (low, trial)
        if high - low <= 1:
            return low
        guess = _aim(seen, usable() if usable else None)
        poor = aimed >= 3 or (aimed >= 2 and high <= LIMIT and 2 * (high - low) > before)
        if guess is not None and high <= LIMIT and guess >= high:
            guess = None  # the line says a batch that failed fits: peaks squeezed against the limit, no line
        elif guess is not None and guess <= low and not poor:
            # The line's edge is where the last batch fitted: check the next batch once. Another fit past the
            # line is the compiler recomputing to fit near the limit, where no line holds: bisect from here.
            guess, checked = (None if checked else low + 1), True
        if guess is not None and not poor:
            if not aimed:
                before = high - low
            # Before anything has failed, no further than 8x the largest that fits: two probes with peaks
            # alike (batch rows padded to a tile) draw a flat line that points anywhere.
            ceiling = high - 1 if high <= LIMIT else min(LIMIT, 8 * max(low, 1))
            trial, aimed = min(max(guess, low + 1), ceiling), aimed + 1
        elif high > LIMIT:
            trial, aimed = min(low * 2, LIMIT), 0
        else:
            trial, aimed = (low + high) // 2, 0


def _aim(seen: dict[int, Probe], usable: int | None) -> int | None:
    """The largest n that the line through two probes' peaks says fits in `usable` bytes (the probes on
    either side of the edge, else the two nearest it), or None without two peaks."""
    points = sorted((p.per_chip, p.total) for p in seen.values() if p.total)
    if usable is None or len(points) < 2:
        return None
    fitting = [pt for pt in points if pt[1] <= usable]
    over = [pt for pt in points if pt[1] > usable]
    pair = [fitting[-1], over[0]] if fitting and over else fitting[-2:] if fitting else over[:2]
    (n0, t0), (n1, t1) = pair
    if t1 <= t0:
        return None
    return int(n0 + (usable - t0) * (n1 - n0) // (t1 - t0))


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
        lines.append(f"| {row.remat} | {row.shown()} | {row.global_batch or '-'} | {peak} | {flops} | "
                     f"{len(row.probes)} ({seconds:.0f}s) |")
    lines += ["", "probes (per chip: peak): " + "; ".join(
        f"{row.remat} " + ", ".join(f"{p.per_chip}: {size(p.total) if p.total else 'refused'}"
                                    f"{'' if p.fits else ' (no)'}" for p in row.probes) for row in table.rows)]
    return "\n".join(lines)
