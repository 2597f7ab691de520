"""`python -m train compile` and `lower` in a child process, so that a crash of a compiler's native code is one line.

The chips' compilers are native libraries inside the Python process (libtpu; XLA's GPU compiler in the CUDA
plugin). A failed internal check in one of them aborts the whole process (SIGABRT) with a native stack dump
on fd 2, which no Python `except` can catch. So the command runs in a child process (the same command line,
with CHILD_ENV naming a report file): the child sends what its native code writes to fd 2 into that file and
keeps Python's own messages (the progress lines, the one-line errors) on the user's stderr. The parent waits:

- the child exits: its exit code is the command's; what native code wrote is passed on (the plugins' expected
  start-up lines held back, train/platforms.py) and the file is removed;
- the child is killed by a signal: one line, "the compiler crashed (SIGABRT) ...", with the native report's
  first fatal line and the file that keeps the whole report, exit 1 (the compiler refused the program); for
  SIGKILL, which no compiler sends itself, the line names the likelier cause, the host's out-of-memory killer.
  With --json, stdout also gets one object saying so;
- the child exits 1 because a native library refused a flag of the user's at start-up (XLA's "Unknown flag in
  XLA_FLAGS", libtpu's "Unknown command line flag"): one line naming the variable and the flag, exit 2 (bad
  input), with --json an object saying so.

SIGINT and SIGTERM reach the child (the terminal sends Ctrl-C to both; a SIGTERM to the parent is passed on):
the child ends as every command does on an interrupt, and the parent returns its code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from train.errors import FAILED_EXIT, USAGE_EXIT

CHILD_ENV = "JAXBLOCK_COMPILER_REPORT"
# A native fatal line: glog's "F1206 12:00:00.000 123 file.cc:198] Check failed: ..." or absl's "*** ..." header.
_FATAL = re.compile(r"^(F\d{4} |.*Check failed|.*(Fatal|FATAL)|\*\*\* )")
# A flag a native library does not know, as it says so before it exits 1: jaxlib's XLA (and the CUDA plugin's)
# for XLA_FLAGS, libtpu (absl) for LIBTPU_INIT_ARGS.
_XLA_UNKNOWN = re.compile(r"Unknown flags? in XLA_FLAGS: (.+)$")
_ABSL_UNKNOWN = re.compile(r"Unknown command line flag '([^']+)'")


def is_child() -> bool:
    return bool(os.environ.get(CHILD_ENV))


def child_setup() -> None:
    """In the child, before any native library loads: fd 2 (native code) to the report file; Python's
    sys.stderr stays on the stderr the command was started with."""
    report = os.environ.pop(CHILD_ENV)
    sys.stderr.flush()
    user = os.dup(2)
    sys.stderr = open(user, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=True)  # noqa: SIM115
    fd = os.open(report, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)


def unknown_flag(native: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The one-line error for a flag a native library refused at start-up, from what it wrote to fd 2; None if
    it wrote no such line."""
    for line in native.splitlines():
        if match := _XLA_UNKNOWN.search(line):
            return (f"error: XLA_FLAGS holds a flag this jaxlib does not know ({match.group(1).strip()}): "
                    f"correct or remove it")
        if match := _ABSL_UNKNOWN.search(line):
            flag = match.group(1)
            where = "LIBTPU_INIT_ARGS" if flag in env.get("LIBTPU_INIT_ARGS", "") else "a flag variable"
            return f"error: {where} holds a flag this libtpu does not know (--{flag}): correct or remove it"
    return None


def run(command: list[str], *, json_out: bool = False, doing: str = "compiling") -> int:
    """Run `command` (a whole `python -m train compile ...` line) as the child; its exit code, or 1 and one
    line if native code killed it, or 2 and one line if native code refused a flag of the user's."""
    handle, name = tempfile.mkstemp(prefix="jaxblock-compiler-report-", suffix=".log")
    os.close(handle)
    report = Path(name)
    child = subprocess.Popen(command, env={**os.environ, CHILD_ENV: str(report)})
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def pass_on(signum: int, frame: Any) -> None:
        if signum != signal.SIGINT:  # Ctrl-C reaches the child from the terminal itself
            child.send_signal(signum)

    for sig in previous:
        signal.signal(sig, pass_on)
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    text = report.read_text(errors="replace") if report.exists() else ""
    refused = unknown_flag(text) if code == FAILED_EXIT else None
    if refused:
        if json_out:
            print(json.dumps({"error": refused}))
        print(refused, file=sys.stderr)
        report.unlink(missing_ok=True)
        return USAGE_EXIT
    if code >= 0:
        from train.platforms import passed_on

        kept = passed_on(text)
        if kept:
            print(kept, file=sys.stderr)
        report.unlink(missing_ok=True)
        return code
    name = _signal_name(-code)
    if name in ("SIGINT", "SIGTERM"):  # interrupted before its own handlers were in place
        report.unlink(missing_ok=True)
        return 128 - code
    fatal = next((line.strip() for line in text.splitlines() if _FATAL.match(line)), "")
    reason = f": {fatal[:300]}" if fatal else ""
    if name == "SIGKILL":  # not the compiler's doing: the kernel's out-of-memory killer, or a kill -9
        line = (f"error: the compile was killed (SIGKILL), most likely by this host's out-of-memory killer: "
                f"compile on a host with more memory, or fewer layers (model.num_layers) to see the layout; what it "
                f"wrote is in {report}")
    else:
        line = (f"error: the compiler crashed ({name}) {doing}{reason}. A fault in the compiler's native code, not "
                f"in the config: try another --layout or model.remat, or another jax/libtpu version; its whole "
                f"report is in {report}")
    if json_out:
        print(json.dumps({"error": line, "crashed": name, "report": str(report)}))
    print(line, file=sys.stderr)
    return FAILED_EXIT


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
