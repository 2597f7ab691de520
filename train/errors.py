"""Every error the command line reports as one line, with its exit code, and what "no room to write" means.

Each class is raised with one line naming the problem and the fix; `train/__main__.py` prints it as
`error: <line>` and exits with `EXIT_CODES[type]` (the first class in the table the error is an instance
of). The modules that raise them re-export the ones they own (e.g. `train.config.ConfigError`), so either
import works. Exit codes: 0 success; 1 a check failed or the run halted; 2 bad input, usage, a busy
workdir, a damaged checkpoint or a full disk; 130 interrupted (train/interrupts.py).
"""

from __future__ import annotations

import errno

OK_EXIT = 0
FAILED_EXIT = 1  # a check failed, or the run halted on non-finite values
USAGE_EXIT = 2  # bad input or usage, a busy workdir, a damaged checkpoint, a full disk
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for Ctrl-C (SIGTERM too)

# errno values that mean "no room to write": a full disk, a quota, a file-size limit (RLIMIT_FSIZE).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class ConfigError(ValueError):
    """A bad config or override: one line naming the key and the fix."""


class DataError(ValueError):
    """A data problem: the message is one line naming the problem and the fix."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incompatible): one line naming the problem and the fix."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files cannot be read (truncated, missing): one line naming the step and file
    (train/checkpoints/repair.py finds, moves aside and falls back from such checkpoints)."""


class WorkdirError(ValueError):
    """A workdir that cannot hold a run: one line naming the problem and the fix."""


class WorkdirBusyError(RuntimeError):
    """Another live process holds the workdir (exit code 2): one line naming the holder and the fix."""


class UsageError(ValueError):
    """Bad command-line input: one line naming the problem and the fix."""


class DiskFullError(OSError):
    """No room to write a run file or a checkpoint (exit code 2): one line naming what and the fix. Whatever
    was being written was rolled back, so rerunning the same command once there is space continues the run."""

    def __str__(self) -> str:
        return str(self.strerror)


class HaltError(RuntimeError):
    """The run stopped on non-finite steps (exit code 1); the message says where and what to do."""


EXIT_CODES: dict[type[BaseException], int] = {
    ConfigError: USAGE_EXIT, DataError: USAGE_EXIT, CheckpointError: USAGE_EXIT, WorkdirError: USAGE_EXIT,
    WorkdirBusyError: USAGE_EXIT, UsageError: USAGE_EXIT, DiskFullError: USAGE_EXIT, HaltError: FAILED_EXIT,
}
ONE_LINE_ERRORS = tuple(EXIT_CODES)
