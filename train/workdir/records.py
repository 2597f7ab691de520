"""What a run records: JSONL metrics, TensorBoard events, a progress bar, the end-of-run curves, and the
per-session metadata (versions, devices, git commit) that goes into run.json.

Files in the workdir: `metrics.jsonl` (one JSON object per line: step, split, values), `tb/` (TensorBoard
event files, tags `split/name`), `curves.png`. Every (split, step) is recorded exactly once: a resumed
run first drops whatever an interrupted run wrote past the restored step (it will be recomputed), and
never writes a (split, step) that is already there.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import struct
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tqdm import tqdm

JSONL_FILE = "metrics.jsonl"
TB_DIR = "tb"
CURVES_FILE = "curves.png"


# errno values that mean "no room to write": a full disk, a quota, a file-size limit (RLIMIT_FSIZE).
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskFullError(OSError):
    """No room to write a run file (exit code 2): one line naming the file and the fix. Whatever was being
    written was rolled back, so rerunning the same command once there is space continues the run."""

    def __str__(self) -> str:
        return str(self.strerror)


def no_space(err: OSError, path: Path | str) -> DiskFullError | None:
    """A DiskFullError for `err` when it means the disk (or quota, or file-size limit) is full, else None."""
    if err.errno not in _NO_SPACE:
        return None
    return DiskFullError(err.errno, f"disk full while writing {Path(path).name} in {Path(path).parent} "
                                    f"({os.strerror(err.errno or 0)}): free space and rerun the same command "
                                    "to continue")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics file; a torn last line (a killed write) is ignored."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and "split" in record:
            records.append(record)
    return records


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write a whole file or nothing: a kill mid-write leaves the previous version in place."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        tmp.unlink(missing_ok=True)  # the previous version stays; a partial copy would only use space
        full = no_space(err, path)
        if full is None:
            raise
        raise full from None
    os.replace(tmp, path)


def read_event_records(path: Path) -> list[tuple[bytes, Any]]:
    """Raw TFRecord frames of an event file with their parsed events (tensorboardX's Event proto);
    stops at a torn tail."""
    from tensorboardX.proto import event_pb2

    data = path.read_bytes()
    out, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        end = pos + 12 + length + 4
        if end > len(data):
            break
        event = event_pb2.Event()
        try:
            event.ParseFromString(data[pos + 12:pos + 12 + length])
        except Exception:  # protobuf's DecodeError: a corrupt frame ends the readable part
            break
        out.append((data[pos:end], event))
        pos = end
    return out


def truncate_events(directory: Path, last_step: int) -> set[tuple[str, int]]:
    """Drop TensorBoard scalars recorded after `last_step`; return the (tag, step) pairs kept."""
    kept_pairs: set[tuple[str, int]] = set()
    if not directory.is_dir():
        return kept_pairs
    for path in sorted(directory.glob("events.out.tfevents.*")):
        records = read_event_records(path)
        kept = [(raw, ev) for raw, ev in records if ev.step <= last_step]
        for _, ev in kept:
            kept_pairs.update((v.tag, ev.step) for v in ev.summary.value)
        if len(kept) != len(records) or sum(len(raw) for raw, _ in records) != path.stat().st_size:
            atomic_write(path, b"".join(raw for raw, _ in kept))
    return kept_pairs


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_metadata(start_step: int) -> dict[str, Any]:
    """One session's record for run.json: when, what ran it, versions, devices, git commit."""
    import flax
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint

    from jaxblock import xla_options

    return {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "start_step": start_step,
        "argv": sys.argv,
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "orbax-checkpoint": orbax.checkpoint.__version__, "numpy": np.__version__},
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "process_count": jax.process_count(),
        "git_commit": _git_commit(),
        "xla_options": xla_options.current().as_dict(),  # CPU model and the XLA option set this session used
    }


class MetricsLog:
    """JSONL + TensorBoard writer for one process (pass enabled=False on non-primary processes)."""

    def __init__(self, workdir: Path, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(workdir) / JSONL_FILE
        self._seen: set[tuple[str, int]] = set()
        self._tb_seen: set[tuple[str, int]] = set()
        self._fd: int | None = None
        self._tb: Any = None
        if not enabled:
            return
        records = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in records).encode())
        self._seen = {(r["split"], r["step"]) for r in records}
        self._tb_seen = truncate_events(Path(workdir) / TB_DIR, resume_step)
        # One O_APPEND descriptor, written a whole line per os.write: a failed write is cut back to the last
        # complete line (see write), and no buffer holds half a line that a later flush could emit.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._workdir, self._resume_step = Path(workdir), resume_step
        self._open_tb()

    def _open_tb(self) -> None:
        # Imported here: tensorboardX imports torch when it is installed, seconds that only a writer needs.
        from tensorboardX import SummaryWriter

        # A distinct file per writer: the default name has one-second resolution, and a writer reusing an
        # existing name would overwrite the steps kept from the previous session.
        self._tb = SummaryWriter(str(self._workdir / TB_DIR), flush_secs=30,
                                 filename_suffix=f".from{self._resume_step}.{time.time_ns()}")

    def write(self, split: str, step: int, values: dict[str, float]) -> None:
        if not self.enabled or (split, step) in self._seen:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else str(float(v))) for k, v in values.items()}
        self._append((json.dumps({"step": step, "split": split, **clean}) + "\n").encode())
        self._seen.add((split, step))
        assert self._tb is not None
        for name, value in values.items():
            tag = f"{split}/{name}"
            if (tag, step) not in self._tb_seen:
                self._tb.add_scalar(tag, float(value), step)
                self._tb_seen.add((tag, step))

    def _append(self, line: bytes) -> None:
        """Append one whole line or nothing: on any error the file is cut back to its previous end."""
        assert self._fd is not None
        start = os.fstat(self._fd).st_size
        try:
            done = 0
            while done < len(line):
                done += os.write(self._fd, line[done:])
        except OSError as err:
            os.ftruncate(self._fd, start)
            full = no_space(err, self.path)
            if full is None:
                raise
            raise full from None

    def flush(self) -> None:
        """Make everything written so far durable (called before each checkpoint, so a kill after the
        checkpoint loses nothing it covers)."""
        if not self.enabled:
            return
        assert self._fd is not None
        try:
            os.fsync(self._fd)
        except OSError as err:  # delayed allocation: a full disk can surface only here
            full = no_space(err, self.path)
            if full is None:
                raise
            raise full from None
        # tensorboardX's flush() does not wait for events still queued for its writer thread; close() does.
        # A new file then takes the following events, so each step's events are on disk before the
        # checkpoint that covers them commits, exactly once.
        assert self._tb is not None
        try:
            self._tb.close()
        except OSError as err:
            full = no_space(err, Path(self._workdir) / TB_DIR)
            if full is None:
                raise
            raise full from None
        self._open_tb()

    def close(self) -> None:
        if not self.enabled or self._fd is None:
            return
        try:
            self.flush()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            assert self._tb is not None
            self._tb.close()


class Progress:
    """A tqdm bar on stderr with loss/accuracy/tokens per second; its ETA comes from tqdm."""

    def __init__(self, total: int, start: int, *, bar: bool, lines: bool, stream: Any = None):
        """bar: show the bar; lines: print `write` lines (False on non-primary processes: they say nothing);
        stream: where both go (default sys.stderr)."""
        self.lines = lines
        self.stream = stream if stream is not None else sys.stderr
        self.bar = tqdm(total=total, initial=start, disable=not bar, file=self.stream, unit="step",
                        dynamic_ncols=True, leave=True)

    def update(self, steps: int, values: dict[str, float]) -> None:
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=False)
        self.bar.update(steps)

    def write(self, line: str) -> None:
        if self.lines:
            self.bar.write(line, file=self.stream)

    def close(self) -> None:
        self.bar.close()


def plot_curves(workdir: Path) -> Path | None:
    """Training and validation loss and accuracy by step, from metrics.jsonl, into curves.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(Path(workdir) / JSONL_FILE)
    if not records:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("loss", "accuracy"), strict=True):
        for split, style in (("train", "-"), ("val", "o-")):
            points = [(r["step"], r[name]) for r in records
                      if r["split"] == split and isinstance(r.get(name), float)]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(xs, ys, style, label=split, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(Path(workdir).name)
    fig.tight_layout()
    out = Path(workdir) / CURVES_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
