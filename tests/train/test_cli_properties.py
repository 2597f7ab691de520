"""Property: whatever overrides and data file a user gives, the CLI exits 0, or exits 2 with one line on
stderr — never a traceback, never another exit code.

The default suite calls the CLI's `main` in-process (stderr captured) with a few examples; the slow variant
runs real `python -m train` processes.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from train.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
# Small and short, so that an example that trains finishes in seconds.
BASE = ["parallel.strategy=single", "train.progress=false", "train.steps=2", "checkpoint.every=2",
        "train.eval_every=2", "train.log_every=1", "data.synthetic_size=200"]
KEYS = ["model.num_layers", "model.block.num_heads", "model.block.model_dim", "model.max_len", "data.max_len",
        "data.buckets", "data.split", "data.format", "data.text_column", "data.label_column", "data.tokenizer",
        "data.labels", "train.batch_size", "train.steps", "checkpoint.every", "data.synthetic_task",
        "modle.num_layers", "train.stpes", "optim", "data", "x.y.z", ""]

values = st.one_of(
    st.integers(-3, 40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["csv", "tsv", "jsonl", "auto", "byte", "bpe", "majority", "", "null", "[]", "[8, 16]",
                     "[16, 8]", "[0.5, 0.5, 0.0]", "{a: 1}", "'", "[", "text", "label"]),
    st.text(max_size=8),
)
overrides = st.lists(st.tuples(st.sampled_from(KEYS), values).map(lambda kv: f"{kv[0]}={kv[1]}"), max_size=3)

rows = st.lists(st.tuples(st.text(max_size=20), st.sampled_from(["pos", "neg", "", "x"])), max_size=30)
data_files = st.one_of(
    st.none(),
    st.binary(max_size=200).map(lambda b: ("csv", b)),
    rows.map(lambda r: ("csv", ("text,label\n" + "".join(f'"{t.replace(chr(34), "")}",{lab}\n' for t, lab in r))
                        .encode("utf-8", "surrogatepass"))),
    rows.map(lambda r: ("jsonl", "".join(f'{{"text": {t!r}, "label": "{lab}"}}\n' for t, lab in r)
                        .encode("utf-8", "surrogatepass"))),
    st.sampled_from([("csv", b""), ("csv", b"text,label\n"), ("csv", b"a,b\n1,2\n"), ("jsonl", b"{not json\n"),
                     ("tsv", b"text\tlabel\n\xff\xfe\tpos\n")]),
)


def argv_for(workdir: Path, extra: list[str], data: tuple[str, bytes] | None) -> list[str]:
    argv = ["--config", TINY, "--workdir", str(workdir), *BASE]
    if data is not None:
        suffix, content = data
        path = workdir.parent / f"data.{suffix}"
        path.write_bytes(content)
        argv += ["data.source=file", f"data.path={path}"]
    return argv + extra


def check(code: int, err: str) -> None:
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert code in (0, 2), (code, err)
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].strip(), err


def _passable(arg: str) -> bool:
    """An argument the OS can pass to a process: no NUL byte, encodable to the file-system encoding."""
    try:
        return b"\0" not in os.fsencode(arg)
    except UnicodeEncodeError:
        return False


@settings(max_examples=6, deadline=None, derandomize=True,  # the default suite repeats; -m slow explores
          suppress_health_check=list(HealthCheck))
@given(extra=overrides, data=data_files)
def test_cli_in_process_exits_0_or_2_with_one_line(extra, data):
    with tempfile.TemporaryDirectory() as tmp:
        argv = argv_for(Path(tmp) / "run", extra, data)
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
        check(code, err.getvalue())


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(extra=overrides, data=data_files)
def test_cli_subprocess_exits_0_or_2_with_one_line(extra, data):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    assume(all(_passable(arg) for arg in extra))  # what no shell can hand a process is not a CLI input
    with tempfile.TemporaryDirectory() as tmp:
        argv = argv_for(Path(tmp) / "run", extra, data)
        done = subprocess.run([sys.executable, "-m", "train", *argv], env=env, capture_output=True, timeout=600)
        check(done.returncode, done.stderr.decode(errors="replace"))

