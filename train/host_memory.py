"""Host memory for XLA's large per-step buffers on a CPU, opt in: transparent huge pages for malloc.

    JAXBLOCK_HUGE_PAGES=on python -m train --config configs/sentiment.yaml --workdir runs/sentiment

XLA's CPU runtime allocates each execution's temporaries as one block with malloc and frees it when the call
ends; glibc serves such a block with a fresh mmap, so every step faults its temporaries in again, 4 KiB at a
time. With `JAXBLOCK_HUGE_PAGES=on` a command re-executes itself once, before it imports JAX, with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`: glibc then asks the kernel for transparent huge pages on those
mappings (2 MiB at a time), and the first line the command prints says so. Off by default: what it buys
depends on the host's kernel and on the step, and it is host tuning, not the library's business; `python -m
bench.ab --only huge_pages` measures it on a machine.

It acts only where it can: Linux, glibc 2.35 or later, transparent huge pages not switched off; never when
GLIBC_TUNABLES already names glibc.malloc.hugetlb (the user's value wins). `keep_freed_blocks()` is the
benchmark's other way to time both libraries without page faults (`python -m bench --malloc keep`): glibc
keeps everything the process frees, memory that is never given back. `status()` says what this process
runs with.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "JAXBLOCK_HUGE_PAGES"  # "on" re-executes with the tunable; anything else keeps glibc's defaults
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_kept = False  # keep_freed_blocks() took effect in this process


def _glibc_at_least(major: int, minor: int) -> bool:
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        parts = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return parts >= (major, minor)


def _thp_possible() -> bool:
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


def _user_tunable(env: dict[str, str] | os._Environ[str]) -> str | None:
    """The value GLIBC_TUNABLES gives glibc.malloc.hugetlb, or None when it does not name it."""
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        key, sep, value = item.partition("=")
        if sep and key.strip() == TUNABLE:
            return value.strip()
    return None


def wanted(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether this process should re-execute itself with the tunable."""
    env = os.environ if env is None else env
    return (env.get(SWITCH, "").strip().lower() in ("on", "1", "true", "yes")
            and _user_tunable(env) is None and sys.platform.startswith("linux") and _glibc_at_least(2, 35)
            and _thp_possible() and bool(getattr(sys, "orig_argv", None)))


def reexec_with_huge_pages() -> None:
    """Replace this process by itself with GLIBC_TUNABLES naming glibc.malloc.hugetlb=1, when `wanted()`;
    otherwise return. Call it before anything heavy is imported: all of it would be imported twice."""
    if not wanted():
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    env = {**os.environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}
    print(f"huge pages: on ({SWITCH}=on): {TUNABLE}=1 for XLA's per-step buffers (train/host_memory.py)",
          file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError:
        return  # could not re-execute: carry on with glibc's defaults


def keep_freed_blocks() -> bool:
    """Make glibc keep what this process frees: one arena for every thread, no block served by mmap, the
    heap never trimmed. A block freed at the end of one step (XLA's temporaries, PyTorch's tensors) is then
    the next step's, with no page faults. Call it before any thread starts (threads started earlier keep
    their own arenas, whose blocks over 64 MiB glibc still maps afresh). The memory is never given back to the
    system. Returns whether glibc took all three settings: False where malloc is not glibc's (nothing
    changed) or glibc refused one."""
    global _kept
    if not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    _kept = all(libc.mallopt(param, value) == 1 for param, value in settings)
    return _kept


def status() -> str:
    """A few words for the `machine:` lines: how malloc serves XLA's large blocks in this process."""
    value = _user_tunable(os.environ)
    if _kept:
        return ("malloc: freed blocks kept (one arena, no mmap, no trimming: keep_freed_blocks)"
                + (f"; glibc.malloc.hugetlb={value}" if value is not None else ""))
    if value == "1":
        return "malloc: transparent huge pages (glibc.malloc.hugetlb=1)"
    if value is not None:
        return f"malloc: glibc.malloc.hugetlb={value} (the user's)"
    return "malloc: glibc's defaults"
