"""Writing a run's files safely: whole or not at all (`atomic_write`, a file; `replace_dir`, a directory
such as an export), and a full disk as one line (`no_space`: a DiskFullError naming the file and the fix,
exit code 2)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from train.errors import NO_SPACE_ERRNOS, ConfigError, DiskFullError


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


def replace_dir(out: Path, write: Callable[[Path], Any], *, what: str,
                earlier: tuple[str, ...] = ("manifest.json", "config.json")) -> Any:
    """Run `write(tmp)` on a new directory beside `out`, then rename it to `out` (an earlier one there, a
    directory holding one of the `earlier` files, is replaced only then). ConfigError/DiskFullError (one
    line) when `out` cannot be written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: pass a directory to write the {what} into")
    ours = any((out / name).is_file() for name in earlier)
    if out.is_dir() and any(out.iterdir()) and not ours:
        raise ConfigError(f"--out {out} is a directory that holds something other than an export: pass a new or "
                          "empty directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as err:
        raise ConfigError(f"cannot write the {what} into {out} ({err.strerror}): pass a writable --out") from None
    try:
        result = write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 and the writers' modes: readable like any other output
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return result
    except OSError as err:
        if err.errno in NO_SPACE_ERRNOS:
            raise DiskFullError(err.errno, f"disk full while writing the {what} into {out}: free space and run the "
                                "command again (nothing was left under that name)") from None
        raise ConfigError(f"cannot write the {what} into {out} ({err.strerror}): pass a writable --out") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
