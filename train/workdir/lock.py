"""One writer per workdir: an OS advisory lock on `<workdir>/.lock`, held for as long as a command writes there.

Training, and `evaluate`/`predict` when they write into the workdir, take the lock; commands that only read
(schema, reading metrics, `restore_run`) do not. The lock is `fcntl.flock` on an open file
descriptor: the kernel drops it when the descriptor closes, which includes every way a process can end
(return, exception, SIGKILL, OOM kill), so a killed run never leaves a stale lock and the next run needs no
cleanup. The lock file itself is never deleted (deleting it while another process waits on it would let two
processes lock two different files); it only holds a description of the current holder (pid, host,
command, start time) so that a refused command can say who holds the workdir.

Shared filesystems and several hosts:
- flock is reliable on a local filesystem. On NFS (v4, or v3 with lockd) Linux emulates flock with POSIX
  byte-range locks, which are honoured across clients; some NFS mounts (`nolock`, `local_lock=flock`) and
  some FUSE/object-store mounts only lock within one host. There, two runs on *different* hosts are not
  kept apart: give each run its own workdir. The holder description still shows who else is writing.
- A multi-host run is one run: only process 0 takes the lock (pass `primary=jax.process_index() == 0`),
  as only process 0 writes metrics, config and summary files; every process writes its own checkpoint
  shards through Orbax, which coordinates them itself.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from train.errors import WorkdirBusyError

LOCK_FILE = ".lock"


def describe_holder(workdir: Path | str) -> dict[str, Any]:
    """What the lock file says about its last holder (empty when there is none or it is unreadable).
    The description alone does not mean the lock is held; `WorkdirLock.acquire` decides that."""
    try:
        record = json.loads((Path(workdir) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _holder_text(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process"
    where = f" on {holder['host']}" if holder.get("host") and holder["host"] != socket.gethostname() else ""
    since = f" since {holder['started']}" if holder.get("started") else ""
    command = f" ({holder['command']})" if holder.get("command") else ""
    return f"process {holder.get('pid', '?')}{where}{command}{since}"


class WorkdirLock:
    """Exclusive, non-blocking lock of a workdir for one writing command.

        with WorkdirLock(workdir, command="train"):
            ...  # the only writer of workdir until the block ends (or the process dies)

    `acquire` raises WorkdirBusyError at once when another process holds it; it never waits. Re-entrant
    use in one process is refused as well (a second `WorkdirLock` on the same workdir is a second writer).
    `primary=False` (non-zero processes of a multi-host run) makes acquire/release no-ops.
    """

    def __init__(self, workdir: Path | str, *, command: str | None = None, primary: bool = True):
        self.workdir = Path(workdir)
        self.path = self.workdir / LOCK_FILE
        self.command = command if command is not None else " ".join(["python", *sys.argv])
        self.primary = primary
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> WorkdirLock:
        if not self.primary or self._fd is not None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise WorkdirBusyError(
                    f"cannot lock workdir {self.workdir} ({err.strerror}): use a workdir on a filesystem "
                    "that supports file locks"
                ) from None
            holder = describe_holder(self.workdir)
            raise WorkdirBusyError(
                f"workdir {self.workdir} is in use by {_holder_text(holder)}: wait for it to finish or stop it "
                f"(kill {holder.get('pid', '<pid>')}), or use another --workdir"
            ) from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "started": datetime.now(UTC).isoformat(timespec="seconds"), "time": time.time()}
        # Rewritten in place (the file must stay the same inode that is locked), then flushed: a reader
        # sees either the old or the new description, never an empty file for long.
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the description stays: it names the last holder)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
