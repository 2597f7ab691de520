"""Damaged checkpoints: find them by restoring, name them in one line, move them aside, fall back.

A full disk or a dying node can leave a checkpoint whose directory is complete in Orbax's eyes (it was
committed by rename) but whose array files are truncated or missing, e.g. `checkpoints/40/params/d/<hash>`
cut short by a copy or a filesystem repair. Orbax lists such a step as the newest; restoring it ends in a
TensorStore/OCDBT error with a several-hundred-line spec, plus asyncio noise from the reads still in flight.

`restore_newest_good` walks the steps from the newest down, restores each with the caller's function, and
stops at the first that restores. Each newer step that failed with a *damage* error (TensorStore could not
read an array, a metadata file is missing or not JSON, an item directory is gone) is moved, whole, into
`<workdir>/checkpoints.damaged/<step>-<UTC time>/` beside the manager's directory, where Orbax never looks,
together with `DAMAGE.txt` holding the full error. Nothing is deleted, and nothing older than the step
that restores is touched. Errors that are not damage (a config whose shapes differ, a bug) propagate
unchanged. When no step restores, nothing is moved and DamagedCheckpointError says which steps failed.

Verification is the restore itself: the caller needs the arrays anyway, and an OCDBT checkpoint records no
per-file sizes or checksums to compare cheaply (a truncated file is found only by reading it). The cost of a
failed attempt is one partial read. Damage that still decodes (flipped bits inside a chunk) is not detected.
Several hosts: every process calls this with the same steps on disk; they try each step in lockstep and
agree (an all-gather) on whether all of them restored it, so all resume from the same good step; only the
primary process moves directories (`primary=`), the others wait for it at a barrier and then, like it,
reload their managers.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from train.errors import NO_SPACE_ERRNOS, DamagedCheckpointError, DiskFullError

DAMAGED_SUFFIX = ".damaged"
DAMAGE_NOTE = "DAMAGE.txt"

# TensorStore's status codes for data it cannot read; its errors reach Python as ValueError("CODE: ...").
_TENSORSTORE = re.compile(r"\b(OUT_OF_RANGE|FAILED_PRECONDITION|NOT_FOUND|DATA_LOSS|INVALID_ARGUMENT|UNKNOWN): ")
_TS_KEY = re.compile(r'(?:Error \w+|Metadata at) "([^"]+)" in OCDBT database')
_TS_DIR = re.compile(r'local file "([^"]+)"(?::? ?([^\n]*))?')


@dataclass
class Restored:
    """What `restore_newest_good` found: the step that restored (None: there were no checkpoints), its
    value (whatever `restore_fn` returned), and one line for each damaged step that was moved aside."""

    step: int | None
    value: Any = None
    notes: list[str] = field(default_factory=list)


def committed_steps(directory: Path) -> list[int]:
    """The step directories Orbax reports (named by an integer; uncommitted saves carry a tmp suffix)."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def describe_damage(err: BaseException, step_dir: Path) -> str | None:
    """'<item>/<array or file>: <reason>' when `err` (or anything in its cause chain) says that files of
    the checkpoint in `step_dir` cannot be read; None when it is some other error."""
    if isinstance(err, DamagedCheckpointError):  # check_compatible could not read the metadata
        inner = describe_damage(err.__context__, step_dir) if err.__context__ is not None else None
        cause = re.search(r"\((\w+)\)", str(err))
        return inner or f"its metadata cannot be read ({cause[1] if cause else 'error'})"
    chain: list[BaseException] = []
    node: BaseException | None = err
    while node is not None and len(chain) < 20:
        chain.append(node)
        node = node.__cause__ or node.__context__
    for e in chain:
        text = str(e)
        status = _TENSORSTORE.search(text)
        if status:
            head = text.split(" [tensorstore_spec")[0].splitlines()[0]
            key, places = _TS_KEY.search(head), [m[1] for m in _TS_DIR.finditer(head)]
            innermost = _TS_DIR.search(head, head.rfind('local file "')) if places else None  # the innermost file
            why = (innermost[2] if innermost and innermost[2] else status[1]).strip().rstrip(".")
            if key and len(places) == 1:  # an array of an item: '<item>/<array key>'
                return f"{Path(places[0]).name}/{key[1]}: {why}"
            return f"{_relative(Path(places[-1]), step_dir) if places else '?'}: {why}"  # a database file
    for e in chain:
        if isinstance(e, FileNotFoundError | json.JSONDecodeError | KeyError):
            text = str(e).strip("'\"")
            names = re.findall(r"(/\S+)", text)
            where = _relative(Path(names[0].rstrip(".")), step_dir) if names else ""
            if isinstance(e, json.JSONDecodeError):
                return f"{_first_bad_json(step_dir) or 'a metadata file'}: not valid JSON ({e.msg})"
            if isinstance(e, KeyError):  # Orbax's item lookup: 'Item "params" was not found ...' or 'params'
                item = re.search(r'Item "([^"]+)" was not found|Unknown key: (\w+)', text)
                return f"{(item[1] or item[2]) if item else text}: missing"
            return f"{where}: missing" if where else text.split(". ")[0]
    return None


def _first_bad_json(step_dir: Path) -> str | None:
    """The first of the step's JSON metadata files that does not parse (they are small: cheap to read)."""
    for path in sorted(step_dir.rglob("*")):
        if (path.is_file() and path.parent.name != "d" and path.suffix not in (".txt", ".ocdbt")
                and path.stat().st_size < 10_000_000):
            try:
                json.loads(path.read_bytes() or b"null")
            except (ValueError, OSError):
                return _relative(path, step_dir)
    return None


def _relative(path: Path, step_dir: Path) -> str:
    try:
        return str(path.relative_to(step_dir))
    except ValueError:
        return str(path)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[Path]:
    """Send file descriptor 2 to a temporary file while a restore runs: a failed TensorStore read leaves
    asyncio reads in flight whose errors are printed as 'Exception ignored in <coroutine>' tracebacks when
    collected. Yields the file's path; the caller keeps what it wants and the file is removed."""
    saved, previous_hook = os.dup(2), sys.unraisablehook
    with tempfile.NamedTemporaryFile(prefix="restore-stderr-", delete=False) as sink:
        path = Path(sink.name)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)

    def keep(unraisable: Any) -> None:
        # A hook another thread installed around ours may hand it on after the file closed: drop the noise.
        with contextlib.suppress(OSError):
            os.write(fd, "".join(traceback.format_exception(unraisable.exc_value)).encode(errors="replace"))

    try:
        sys.stderr.flush()
        os.dup2(fd, 2)
        sys.unraisablehook = keep
        yield path
    finally:
        gc.collect()  # collect the abandoned coroutines now, while their noise goes to the file
        sys.stderr.flush()
        sys.unraisablehook = previous_hook
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)
        with contextlib.suppress(OSError):
            path.unlink()


def quarantine(directory: Path, step: int, detail: str) -> Path:
    """Move `directory/<step>` to `<directory>.damaged/<step>-<UTC time>/` (same filesystem: a rename)
    with `DAMAGE.txt` holding `detail`; return the new path."""
    target_root = directory.parent / (directory.name + DAMAGED_SUFFIX)
    target_root.mkdir(exist_ok=True)
    target = target_root / f"{step}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}"
    os.replace(directory / str(step), target)
    (target / DAMAGE_NOTE).write_text(detail)
    return target


def restore_newest_good(
    directory: Path | str,
    restore_fn: Callable[[int], Any],
    *,
    steps: list[int] | None = None,
    primary: bool = True,
    together: bool | None = None,
) -> Restored:
    """Restore the newest step of an Orbax CheckpointManager `directory` that reads back.

    restore_fn(step) returns the restored value (e.g. `lambda s: ckpts.restore(s, target)`). Steps default
    to `committed_steps(directory)`. Damaged newer steps are moved aside (by the primary process only) and
    described in `Restored.notes`, e.g. "checkpoint 90 is damaged (params/encoder.embedding/0.0: Requested
    byte range [0, 7596) is not valid for value of size 20); moved to checkpoints.damaged/90-...; resuming
    from 60". A CheckpointError from restore_fn that is not damage (shapes differ) and any other error
    propagate. Raises DamagedCheckpointError, moving nothing, when every step is damaged.
    After steps were moved, a CheckpointManager opened earlier on `directory` must `reload()`.

    together (default: when JAX runs several processes): every process of the run calls this with the
    same steps, and they go through them in lockstep: each tries a step, then they agree (one small
    all-gather) whether every process restored it, so a step damaged only in the files one process reads
    is refused by all, and all resume from the same good step. The primary process then moves the
    damaged steps while the others wait at a barrier, so no process reads the directory mid-move.
    """
    directory = Path(directory).absolute()
    if together is None:
        together = _process_count() > 1
    candidates = sorted(committed_steps(directory) if steps is None else steps, reverse=True)
    damaged: list[tuple[int, str, str]] = []  # (step, one-line reason, full detail)
    for step in candidates:
        value, failure = None, None
        with quiet_stderr() as noise:
            try:
                value = restore_fn(step)
            except Exception as err:  # classified below; what is not damage is re-raised unchanged
                reason = describe_damage(err, directory / str(step))
                if reason is None:
                    raise
                failure = (step, reason, "".join(traceback.format_exception(err)) + "\n--- stderr ---\n" + _read(noise))
        if together:
            failure = _agreed_failure(step, failure)
        if failure is not None:
            damaged.append(failure)
            continue
        return Restored(step, value, _set_aside(directory, damaged, step, primary, together))
    if damaged:
        listed = "; ".join(f"checkpoint {s}: {r}" for s, r, _ in damaged)
        raise DamagedCheckpointError(
            f"no checkpoint in {directory} restores ({listed}): move them aside to start over in this "
            "workdir, or use a new --workdir"
        )
    return Restored(None)


def _set_aside(directory: Path, damaged: list[tuple[int, str, str]], step: int, primary: bool,
               together: bool) -> list[str]:
    """Move the damaged steps (the primary process); with `together`, the others wait until it has."""
    notes = []
    for bad, reason, detail in damaged:
        where = "left in place (not the primary process)"
        if primary:
            moved = quarantine(directory, bad, detail)
            where = f"moved to {moved.parent.name}/{moved.name}"
        elif together:
            where = f"moved to {directory.name}{DAMAGED_SUFFIX}/ by the primary process"
        notes.append(f"checkpoint {bad} is damaged ({reason}); {where}; resuming from {step}")
    if together and damaged:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"damaged checkpoints before {step} moved aside")
    return notes


def _process_count() -> int:
    import jax

    return int(jax.process_count())


def _agreed_failure(step: int, failure: tuple[int, str, str] | None) -> tuple[int, str, str] | None:
    """Every process's outcome of restoring `step`, gathered: None when all restored it, else the first
    failing process's (step, reason, detail), the reason naming that process when it is another one."""
    import json

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    mine = json.dumps(None if failure is None else [failure[1], failure[2][-4000:]]).encode()
    raw = np.frombuffer(mine, np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    outcomes = [json.loads(everyone[i, :n].tobytes()) for i, n in enumerate(sizes)]
    for index, outcome in enumerate(outcomes):
        if outcome is not None:
            reason = outcome[0] if index == jax.process_index() else f"{outcome[0]}, read by process {index}"
            return step, reason, outcome[1]
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-20000:]
    except OSError:
        return ""


# TensorStore reports a failed write as ValueError("RESOURCE_EXHAUSTED: ... [os_error_code='28']") (ENOSPC),
# or its message (strerror) without the code.
_NO_SPACE_CODE = re.compile("|".join([f"os_error_code='({'|'.join(str(n) for n in sorted(NO_SPACE_ERRNOS))})'",
                                      *(re.escape(os.strerror(n)) for n in sorted(NO_SPACE_ERRNOS))]))


def save_failed_for_space(err: BaseException, directory: Path | str, step: int | None) -> DiskFullError | None:
    """A one-line DiskFullError when a checkpoint save failed for lack of space, else None.

    Orbax's async save raises this from `CheckpointManager.wait_until_finished` (also from the next `save`,
    or from `save` itself when synchronous), after logging each failed thread's traceback through absl.
    The unfinished step stays in `<step>.orbax-checkpoint-tmp`, which Orbax never lists and removes on the
    next start, so every older checkpoint is intact and a rerun resumes from the newest of them."""
    node: BaseException | None = err
    for _ in range(20):
        if node is None:
            break
        if (isinstance(node, OSError) and node.errno in NO_SPACE_ERRNOS) or _NO_SPACE_CODE.search(str(node)):
            which = f"checkpoint {step}" if step is not None else "a checkpoint"
            return DiskFullError(errno.ENOSPC, f"disk full while saving {which} in {directory}: free space and "
                                               "rerun the same command to continue from the newest complete checkpoint")
        node = node.__cause__ or node.__context__
    return None


@contextlib.contextmanager
def saves_report_full_disk(directory: Path | str, step: int | None) -> Iterator[None]:
    """Around a checkpoint save, wait or close: a failure for lack of space becomes the one-line
    DiskFullError of `save_failed_for_space`; any other error propagates unchanged."""
    try:
        yield
    except Exception as err:
        full = save_failed_for_space(err, directory, step)
        if full is None:
            raise
        raise full from None
