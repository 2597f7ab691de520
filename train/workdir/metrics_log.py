"""What a run records per step: `metrics.jsonl` (one JSON object per line: step, split, values) and
`tb/` (TensorBoard event files, tags `split/name`). Every (split, step) is recorded exactly once: a resumed
run first drops whatever an interrupted run wrote past the restored step (it will be recomputed), and
never writes a (split, step) that is already there.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

from train.workdir.files import atomic_write, no_space

JSONL_FILE = "metrics.jsonl"
TB_DIR = "tb"


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
