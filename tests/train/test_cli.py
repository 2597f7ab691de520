"""The command line: the main path end to end, and the bad-input catalogue — each case one line on stderr,
exit code 2, and an existing workdir byte-for-byte unchanged."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import STANDARD as FAST
from train.__main__ import main
from train.checkpoints.restore import restore_run
from train.data.labelled import encode_texts
from train.tasks import CLASSIFICATION

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")


def snapshot(directory: Path) -> dict[str, tuple[str, int]]:
    """Every path under `directory` with its content hash (files) and modification time; not `.lock`, which
    names whichever command last held the workdir (the workdir is locked before its run is read)."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.name == ".lock":
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path.relative_to(directory))] = (digest, path.stat().st_mtime_ns)
    out["."] = ("dir", directory.stat().st_mtime_ns)
    return out


@pytest.fixture
def trained(reference_run) -> Path:
    """The shared finished tiny run (read only: the bad-input cases assert it stays unchanged)."""
    return reference_run[0]


@pytest.fixture
def data_files(tmp_path) -> dict[str, Path]:
    files = {
        "missing_column.csv": "text,sentiment\ngood film,pos\nbad film,neg\n",
        "unknown_label.csv": "text,label\ngood film,pos\nbad film,neg\nso-so film,neutral\n",
        "empty.csv": "",
        "good.csv": "text,label\n" + "".join(f"film number {i},{'pos' if i % 2 else 'neg'}\n" for i in range(30)),
        "malformed.jsonl": '{"text": "good film", "label": "pos"}\n{"text": "bad film", "label": \n',
    }
    out = {}
    for name, content in files.items():
        out[name.split(".")[0]] = tmp_path / name
        (tmp_path / name).write_text(content)
    return out


def run_bad(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's usage errors leave through sys.exit, as in a real process
        code = exit_info.code
    captured = capsys.readouterr()
    assert code == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


CATALOGUE = [
    # (case, extra argv after --workdir, expected fragment of the one-line error)
    ("unknown config key", ["model.blocks.model_dim=64"], "unknown key 'model.blocks'"),
    ("wrong value type", ["train.steps=many"], "train.steps: Input should be a valid integer"),
    ("bad value", ["optim.lr=-1"], "optim.lr: Input should be greater than 0"),
    ("impossible model shape", ["model.block.num_heads=3"], "model_dim=32 is not divisible by num_heads=3"),
    ("positions shorter than a bucket", ["model.max_len=8"], "model.max_len=8 is shorter than the largest bucket 16"),
    ("missing data file", ["data.source=file", "data.path=/no/such/reviews.csv"],
     "data file /no/such/reviews.csv not found"),
    ("CSV missing a column", ["data.source=file", "data.path={missing_column}"],
     "has no column 'label' (columns: text, sentiment): set data.label_column"),
    ("label outside the classes", ["data.source=file", "data.path={unknown_label}", "data.labels=[neg,pos]"],
     "line 4: label 'neutral' is not in data.labels ['neg', 'pos']"),
    ("empty data file", ["data.source=file", "data.path={empty}"], "is empty: give it a header"),
    ("malformed data file", ["data.source=file", "data.path={malformed}"], "line 2: not valid JSON"),
    ("checkpoint from another config", ["model.block.ffn_dim=48"],
     "parameter encoder/stack/layers_0/ffn/linear1/bias has shape (64,) in the checkpoint but (48,)"),
    ("tokenizer of another kind", ["data.source=file", "data.path={good}"],
     "the run's tokenizer in"),
    ("not key=value", ["optim.lr"], "override 'optim.lr' is not key=value"),
]


@pytest.mark.parametrize(("case", "extra", "expected"), CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_is_one_line_exit_2_and_the_workdir_is_unchanged(trained, data_files, capsys, case, extra, expected):
    extra = [arg.format(**{k: str(v) for k, v in data_files.items()}) for arg in extra]
    before = snapshot(trained)
    line = run_bad(capsys, ["--config", TINY, "--workdir", str(trained), *FAST, *extra])
    assert line.startswith("error: ") and expected in line, line
    assert snapshot(trained) == before


def test_workdir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "run"
    path.write_text("not a directory")
    line = run_bad(capsys, ["--config", TINY, "--workdir", str(path), *FAST])
    assert line == f"error: workdir {path} is a file: pass a directory path for --workdir"
    assert path.read_text() == "not a directory"


def test_non_empty_directory_without_a_run(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    line = run_bad(capsys, ["--config", TINY, "--workdir", str(tmp_path), *FAST])
    assert "is not empty and holds no run" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_evaluate_and_predict_without_a_checkpoint(tmp_path, capsys):
    line = run_bad(capsys, ["evaluate", "--workdir", str(tmp_path)])
    assert "holds no run (config.yaml missing): train first" in line
    assert not any(tmp_path.iterdir())
    line = run_bad(capsys, ["predict", "--workdir", str(tmp_path / "nope"), "some text"])
    assert "does not exist" in line


def test_usage_errors_are_one_line(capsys):
    assert "the following arguments are required: --workdir" in run_bad(capsys, ["--config", TINY])
    assert "invalid choice: 'dev'" in run_bad(capsys, ["evaluate", "--workdir", "w", "--split", "dev"])
    assert "no --config given" in run_bad(capsys, ["--workdir", "/tmp/jaxblock-no-such-run"])


def test_help_documents_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in ("evaluate", "predict", "diagnose", "study-ln", "schema", "--config", "--workdir", "exit codes"):
        assert word in text


def test_schema_lists_every_key(capsys):
    assert main(["schema"]) == 0
    table = capsys.readouterr().out
    for key in ("`model.block.num_heads`", "`optim.lr`", "`train.nonfinite`", "`checkpoint.keep_best`"):
        assert key in table


def test_evaluate_predict_and_rerun_of_a_finished_run(reference_run, tmp_path, capsys):
    trained, summary = tmp_path / "run", reference_run[1]
    shutil.copytree(reference_run[0], trained)
    assert main(["evaluate", "--workdir", str(trained)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["validation", "test"]
    assert out[0].endswith("(100 examples, checkpoint 10)")
    # The checkpoint evaluated is the one the run tested (the latest: the run keeps no best).
    assert out[1].startswith(f"test: accuracy {summary['test_accuracy']:.4f} loss {summary['test_loss']:.4f}")

    texts = ["3 5 7 3", "4 6 8"]
    assert main(["predict", "--workdir", str(trained), *texts]) == 0
    header, *rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert header == ["label", "probability", "truncated", "text"]
    # Recomputed here from the checkpoint: the softmax of the classifier's logits, argmax and its probability.
    restored = restore_run(trained)
    config, params, tokenizer, labels = restored.config, restored.params, restored.tokenizer, restored.label_names
    batch = encode_texts(tokenizer, texts, config.data.max_len, config.data.buckets)
    logits = CLASSIFICATION.build_model(config.model).apply({"params": params}, batch["tokens"], batch["valid_tokens"])
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    assert rows == [[labels[int(p.argmax())], f"{p.max():.4f}", "no", t] for p, t in zip(probs, texts, strict=True)]

    before = snapshot(trained / "checkpoints")
    assert main(["--workdir", str(trained), *FAST]) == 0  # finished: re-reports, trains nothing
    assert "done: 10 steps (0 this session" in capsys.readouterr().out
    assert snapshot(trained / "checkpoints") == before


@pytest.mark.slow
def test_python_m_train_end_to_end(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "train", "--config", TINY, "--workdir", str(tmp_path / "w"), *FAST],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("done: 10 steps (10 this session")
    assert "step 5: validation accuracy" in done.stderr  # progress goes to stderr
    assert (tmp_path / "w/curves.png").is_file()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("setpriv") is None and os.geteuid() == 0,
                    reason="as root, an unwritable directory needs setpriv to drop CAP_DAC_OVERRIDE")
def test_unwritable_workdir(trained, tmp_path):
    workdir = tmp_path / "locked"
    shutil.copytree(trained, workdir)
    before = snapshot(workdir)
    workdir.chmod(0o555)
    # root ignores permissions unless the capability that overrides them is dropped
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"] if os.geteuid() == 0 else []
    try:
        done = subprocess.run([*prefix, sys.executable, "-m", "train", "--config", TINY, "--workdir", str(workdir),
                               *FAST], capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    finally:
        workdir.chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"error: workdir {workdir} is not writable: fix its permissions or pass "
                                   "another --workdir")
    assert snapshot(workdir) == before


def _summary(done: subprocess.CompletedProcess) -> dict[str, float]:
    import re

    assert done.returncode == 0, done.stderr
    found = re.search(r"best validation accuracy ([\d.]+) at step \d+; test accuracy ([\d.]+)", done.stdout)
    assert found, done.stdout
    return {"val": float(found.group(1)), "test": float(found.group(2))}


@pytest.mark.slow
def test_synthetic_config_needs_attention(tmp_path):
    """configs/synthetic.yaml learns pair_match (>= 0.95); without attention it stays near chance."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    base = [sys.executable, "-m", "train", "--config", str(ROOT / "configs/synthetic.yaml"), "train.progress=false"]
    full = _summary(subprocess.run([*base, "--workdir", str(tmp_path / "full")], env=env, capture_output=True,
                                   text=True))
    assert full["val"] >= 0.95 and full["test"] >= 0.95
    ablated = _summary(subprocess.run([*base, "--workdir", str(tmp_path / "bag"), "model.block.ablate=attention"],
                                      env=env, capture_output=True, text=True))
    assert abs(ablated["val"] - 0.5) < 0.06 and abs(ablated["test"] - 0.5) < 0.06


@pytest.mark.slow
def test_sentiment_main_job(tmp_path):
    """The README's first command: Rotten Tomatoes, under 10 minutes, test accuracy >= 0.72."""
    import time

    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "train", "--config", str(ROOT / "configs/sentiment.yaml"),
                           "--workdir", str(tmp_path / "sentiment"), "train.progress=false"],
                          env=env, capture_output=True, text=True)
    assert _summary(done)["test"] >= 0.72
    assert time.monotonic() - start < 600
