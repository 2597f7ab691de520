"""Writing a run's files safely: whole or not at all (`atomic_write`), and a full disk as one line
(`no_space`: a DiskFullError naming the file and the fix, exit code 2)."""

from __future__ import annotations

import os
from pathlib import Path

from train.errors import NO_SPACE_ERRNOS, DiskFullError


def no_space(err: OSError, path: Path | str) -> DiskFullError | None:
    """A DiskFullError for `err` when it means the disk (or quota, or file-size limit) is full, else None."""
    if err.errno not in NO_SPACE_ERRNOS:
        return None
    return DiskFullError(err.errno, f"disk full while writing {Path(path).name} in {Path(path).parent} "
                                    f"({os.strerror(err.errno or 0)}): free space and rerun the same command "
                                    "to continue")


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
