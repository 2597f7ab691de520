"""A stream with a worker process leaves nothing at exit: no "leaked shared_memory" warning from
multiprocessing's resource tracker, no "Exception ignored" from Grain's iterators finalized during
interpreter shutdown, whether the stream was closed or not, and a closed stream refuses to read."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import stream_config, stream_tokenizer

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.conftest import stream_config, stream_tokenizer
from train.data.stream import BatchStream

if __name__ == "__main__":
    corpus = Path(sys.argv[2])
    stream = BatchStream(stream_config(corpus, batch_rows=64, row_len=64), stream_tokenizer(), prefetch="process")
    last = [next(stream) for _ in range(5)][-1]  # a batch still referenced at exit, as the loop keeps one
    if sys.argv[3] == "close":
        stream.close()
        stream.close()
    print("done")
"""


def _child(tmp_path: Path, source: str) -> tuple[list[str], dict[str, str]]:
    """The command that runs `source` as a script on a 600-line corpus (argv: tests dir, corpus), and its env."""
    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"{i}\n" for i in range(600)))
    script = tmp_path / "child.py"
    script.write_text(source)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return [sys.executable, str(script), str(ROOT), str(corpus)], env


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_process_prefetch_stream_leaves_nothing_on_stderr_at_exit(tmp_path: Path, how: str) -> None:
    command, env = _child(tmp_path, CHILD)
    done = subprocess.run([*command, how], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr
    assert done.stderr == ""  # the whole stderr, to the end of the process


def test_a_closed_stream_refuses_to_read(tmp_path: Path) -> None:
    from train.data.stream import BatchStream

    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"{i}\n" for i in range(600)))
    with BatchStream(stream_config(corpus), stream_tokenizer(), prefetch="thread") as stream:
        next(stream)
    with pytest.raises(RuntimeError, match="the stream was closed"):
        next(stream)


KILLED = """
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.conftest import stream_config, stream_tokenizer
from train.data.stream import BatchStream

if __name__ == "__main__":
    stream = BatchStream(stream_config(Path(sys.argv[2]), batch_rows=64, row_len=64), stream_tokenizer(),
                         prefetch="process")
    next(stream)
    print("reading", flush=True)
    time.sleep(600)  # killed with SIGKILL here, its worker process still running
"""


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (read from /proc; zombies count as gone)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads processes from Linux's /proc")
def test_the_worker_process_ends_when_its_training_process_is_killed(tmp_path: Path) -> None:
    """kill -9 (a preemption, an OOM kill) gives the stream no chance to stop its worker: the worker must
    notice it lost its parent and exit, not wait forever as a child of init, holding its memory."""
    command, env = _child(tmp_path, KILLED)
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "reading\n"
        workers = [p for child in _children(proc.pid) for p in [child, *_children(child)]]
        assert workers, "no worker process was started"
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if _alive(p)], "the worker outlived its killed parent"
