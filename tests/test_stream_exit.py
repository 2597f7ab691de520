"""A stream with a worker process leaves nothing at exit: no "leaked shared_memory" warning from
multiprocessing's resource tracker, no "Exception ignored" from Grain's iterators finalized during
interpreter shutdown, whether the stream was closed or not, and a closed stream refuses to read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stream_config, stream_tokenizer

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from conftest import stream_config, stream_tokenizer
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


@pytest.mark.slow
@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_process_prefetch_stream_leaves_nothing_on_stderr_at_exit(tmp_path: Path, how: str) -> None:
    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"{i}\n" for i in range(600)))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script), str(ROOT / "tests"), str(corpus), how], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
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
