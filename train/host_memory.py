"""Transparent huge pages for the large blocks malloc hands XLA: the process re-executes itself once with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, before it imports JAX.

    from train.host_memory import reexec_with_huge_pages
    reexec_with_huge_pages()   # first thing in a command's `__main__`; returns when there is nothing to do

Why: XLA's CPU runtime allocates each execution's temporary buffer (one block: 472 MiB for the N8 L256 D512
training step, 230 MiB for the BERT fine-tuning step) with malloc from a worker thread and frees it when the
call ends. glibc serves such a block with a fresh mmap and returns it with munmap, so every step faults
its temporaries in again, 4 KiB at a time: 55,000-127,000 minor page faults and 117-248 ms of system time
a step on the benchmark steps, 20-30% of their time (docs/performance-cpu.md). With the tunable, glibc
asks the kernel for transparent huge pages on those mappings (madvise): 2 MiB at a time, a few hundred
faults a step, the same memory.

The other way to the same end, `keep_freed_blocks()`, is not the default here: glibc keeps everything the
process frees (one arena, no mmap, no trimming) and serves the next step's block from the heap without a
fault. It acts at once, without re-executing, and for every library in the process; but the memory is
never given back, and it fragments: one step called again and again stayed at the same size (the BERT step
over 60 calls, the D512 step over 40), the two alternating, as a training loop alternates its train and
eval programs, grew from 1.9 to 2.8 GiB in 15 rounds of one run (AMD EPYC, 2026-12-03). `python -m bench
--malloc keep` uses it to time both libraries in one process without page faults.

Not for a process that also runs PyTorch: timed interleaved with PyTorch's eager step in one process, the
N8 L256 D512 step took 850-1,080 ms instead of 530-590 ms alone, with the same page faults but 590-790 ms of
system time instead of 40-70 (AMD EPYC, 2026-12-02); with glibc's defaults it took 650-770 ms either way.
So `python -m bench`, which times both libraries in one process, and the transformers peer keep glibc's
defaults; the commands that run only JAX re-execute (`python -m train`, bench.profile, bench.tune_xla,
bench.ab's children).

The tunable is read only when a process starts, hence the re-execution (same process id, arguments,
standard streams; one extra interpreter start before any heavy import). It happens only where it can
act: Linux, glibc 2.35 or later, transparent huge pages not switched off; never when GLIBC_TUNABLES
already names glibc.malloc.hugetlb (the user's value wins, and the re-executed process finds its own),
nor with JAXBLOCK_HUGE_PAGES=off. `status()` says what this process runs with.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "JAXBLOCK_HUGE_PAGES"  # "off" keeps glibc's defaults
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
    return (env.get(SWITCH, "").strip().lower() not in ("off", "0", "false", "no")
            and _user_tunable(env) is None and sys.platform.startswith("linux") and _glibc_at_least(2, 35)
            and _thp_possible() and bool(getattr(sys, "orig_argv", None)))


def reexec_with_huge_pages() -> None:
    """Replace this process by itself with GLIBC_TUNABLES naming glibc.malloc.hugetlb=1, when `wanted()`;
    otherwise return. Call it before anything heavy is imported: all of it would be imported twice."""
    if not wanted():
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    env = {**os.environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}
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
