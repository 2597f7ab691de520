"""train/host_memory.py: asked to (JAXBLOCK_HUGE_PAGES=on), a command re-executes itself once with
glibc.malloc.hugetlb=1 (same process id, the tunable in its environment) and says so first; never unasked,
when the user named the tunable, or where it cannot act; and (slow) with it a program whose temporaries are
large runs again with a small fraction of the page faults it takes without. keep_freed_blocks(): a large
block freed in a thread is served again without faults."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from train import host_memory

ROOT = Path(__file__).resolve().parents[2]
ACTS_HERE = host_memory.wanted({host_memory.SWITCH: "on"})
SHOW = ("import os, sys; print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), flush=True); "
        "from train.host_memory import reexec_with_huge_pages; reexec_with_huge_pages()")


def _run(code: str, **env: str) -> list[str]:
    return _done(code, **env).stdout.strip().splitlines()


def _done(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.SWITCH)}
    return subprocess.run([sys.executable, "-c", code], env={**base, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=True)


def test_wanted_only_when_asked_where_it_can_act_and_the_user_has_not_decided(monkeypatch):
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(host_memory, "_thp_possible", lambda: True)
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    on = {host_memory.SWITCH: "on"}
    assert host_memory.wanted(on)
    assert not host_memory.wanted({})  # opt in: off unless asked
    assert not host_memory.wanted({host_memory.SWITCH: "off"})
    assert not host_memory.wanted({**on, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert host_memory.wanted({**on, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})  # other tunables are kept
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.31"))  # before the tunable
    assert not host_memory.wanted(on)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))  # musl, or not Linux
    assert not host_memory.wanted(on)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(host_memory, "_thp_possible", lambda: False)  # transparent huge pages: never
    assert not host_memory.wanted(on)


def test_status_names_the_setting(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert "transparent huge pages" in host_memory.status()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert host_memory.status() == "malloc: glibc.malloc.hugetlb=0 (the user's)"
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert host_memory.status() == "malloc: glibc's defaults"


@pytest.mark.skipif(not ACTS_HERE, reason="needs Linux, glibc >= 2.35 and transparent huge pages")
def test_asked_the_process_reexecutes_itself_once_with_the_tunable_and_says_so_first():
    done = _done(SHOW, JAXBLOCK_HUGE_PAGES="on")
    first, second = done.stdout.strip().splitlines()
    assert first.split()[1] == "None" and second.split()[1] == "glibc.malloc.hugetlb=1"
    assert first.split()[0] == second.split()[0]  # the same process
    assert done.stderr.startswith("huge pages: on (JAXBLOCK_HUGE_PAGES=on): glibc.malloc.hugetlb=1")
    (only,) = _run(SHOW)  # not asked
    assert only.split()[1] == "None"
    (only,) = _run(SHOW, JAXBLOCK_HUGE_PAGES="on", GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert only.split()[1] == "glibc.malloc.hugetlb=0"
    first, second = _run(SHOW, JAXBLOCK_HUGE_PAGES="on", GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert second.split()[1] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


# A jitted program with ~300 MiB of temporaries, called again and again: the minor page faults of three calls.
FAULTS = """
from train.host_memory import reexec_with_huge_pages
reexec_with_huge_pages()
import json, resource
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.sum(jnp.cumsum(jnp.sin(x) * 2.0, axis=0) * jnp.cos(x)))
x = jnp.ones((6400, 4096), jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    f(x).block_until_ready()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


@pytest.mark.slow
@pytest.mark.skipif(not ACTS_HERE, reason="needs Linux, glibc >= 2.35 and transparent huge pages")
def test_huge_pages_take_a_fraction_of_the_page_faults():
    huge = int(_run(FAULTS, XLA_FLAGS="", JAXBLOCK_HUGE_PAGES="on")[-1])
    small = int(_run(FAULTS, XLA_FLAGS="")[-1])
    pages = 3 * 6400 * 4096 * 4 // 4096  # one [6400, 4096] float32 temporary a call, in 4 KiB pages
    assert small > pages  # without: every call faults its temporaries in again
    assert huge < small // 20, (huge, small)


# A 256 MiB block malloc'd, written, freed, three times in a thread started after the call (as XLA's workers
# are): the minor page faults of the last two rounds, and what keep_freed_blocks() returned.
KEEP = """
import ctypes, json, resource, threading
from train import host_memory
kept = host_memory.keep_freed_blocks() if {keep} else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size, faults = 256 * 2**20, []
def rounds():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
worker = threading.Thread(target=rounds)
worker.start()
worker.join()
print(json.dumps([kept, sum(faults[1:]), host_memory.status()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="needs glibc's malloc on Linux")
@pytest.mark.slow  # a subprocess
def test_keep_freed_blocks_serves_a_freed_block_again_without_page_faults():
    kept, again, status = json.loads(_run(KEEP.format(keep=True))[-1])
    plain, fresh, plain_status = json.loads(_run(KEEP.format(keep=False))[-1])
    pages = 2 * 256 * 2**20 // 4096
    assert kept and not plain
    assert fresh > pages // 2  # glibc's defaults: a block this large is mapped afresh and faults in each round
    assert again < pages // 100, (again, fresh)
    assert status.startswith("malloc: freed blocks kept") and plain_status == "malloc: glibc's defaults"
    (_, _, both) = json.loads(_run(KEEP.format(keep=True), GLIBC_TUNABLES="glibc.malloc.hugetlb=1")[-1])
    assert both.startswith("malloc: freed blocks kept") and both.endswith("glibc.malloc.hugetlb=1")
