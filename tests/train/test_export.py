"""`python -m train export`: the artifact loads with the packages docs/serving.md installs alone and gives `predict`'s
numbers; damaged artifacts and bad input are one line; the exported tokenizer gives the run's ids; the
transformers directory gives our predictions."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT, SYMBOL_TEXTS
from train.__main__ import main
from train.errors import CheckpointError

SERVING_DOCS = (ROOT / "docs/serving.md").read_text(encoding="utf-8")
DOCS_BLOCK = re.search(r"```python\n(.*?)```", SERVING_DOCS, re.DOTALL)
DOCS_INSTALL = re.search(r"^pip install (.+?)\s+# what loading an export needs$", SERVING_DOCS, re.MULTILINE)
TEXTS = ["a gripping, funny film", "dull and overlong"]  # the docs block's texts
MODEL_CODE = ("jaxblock", "flax", "optax", "orbax", "train")


def _named_distributions() -> list[str]:
    """The distributions the docs' install line names, and every one they require (installed here): what
    a venv holding only that line's packages would hold."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    assert DOCS_INSTALL is not None, "docs/serving.md has no `pip install ...  # what loading an export needs`"
    seen: set[str] = set()
    todo = DOCS_INSTALL.group(1).split()
    while todo:
        name = str(canonicalize_name(todo.pop()))
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency not installed here: nothing of it can be imported anyway
        for text in requires:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return sorted(seen)


# Runs the docs block (argv[1]) where a module of an installed distribution imports only if that
# distribution is in argv[2] (a JSON list; the standard library always imports), then prints its `probs`.
# Stdlib only: it also runs in a fresh venv.
_ONLY_NAMED_RUNNER = r"""
import importlib.abc, importlib.metadata, json, re, sys
ALLOWED = set(json.loads(sys.argv[2]))
MODEL_CODE = ("jaxblock", "flax", "optax", "orbax", "train")
OWNERS = importlib.metadata.packages_distributions()
def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()
class OnlyNamed(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        owners = OWNERS.get(top, [])
        if top in MODEL_CODE or (owners and not any(canonical(d) in ALLOWED for d in owners)):
            raise ImportError(f"{name} ({', '.join(owners) or 'this repository'}) is not installed by the docs")
sys.meta_path.insert(0, OnlyNamed())
for name in MODEL_CODE:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        sys.exit(f"{name} was importable")
namespace = {"__name__": "__main__"}
exec(compile(open(sys.argv[1]).read(), "docs/serving.md", "exec"), namespace)
loaded = sorted({m.partition(".")[0] for m in sys.modules} & set(MODEL_CODE))
print("RESULT " + json.dumps({"probs": namespace["probs"].tolist(), "blocked_loaded": loaded}))
"""


def _export(workdir: Path, *extra: str) -> Path:
    assert main(["export", "--workdir", str(workdir), *extra]) == 0
    out = next((Path(extra[i + 1]) for i, a in enumerate(extra) if a == "--out"), workdir / "exported")
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny run (the reference run's model and steps: its compiled programs are in the suite's cache),
    exported with the defaults. Not the shared reference run itself, so this file runs beside that group."""
    from tests.conftest import tiny_config
    from train import run

    workdir = tmp_path_factory.mktemp("export") / "run"
    # The reference run's steps (the same train step program), without its diagnostics and step-5
    # validation and checkpoint, which nothing here reads.
    run.train(tiny_config("train.diagnostics_every=0", "train.eval_every=10", "checkpoint.every=10"), workdir)
    return _export(workdir)


def _run_docs_block(export: Path, cwd: Path, python: str | Path = sys.executable) -> subprocess.CompletedProcess[str]:
    """The docs block as written, in `cwd` (runs/sentiment/exported there is `export`), by `python`, where
    only the docs' install line's packages import (and never this repository's model code)."""
    (cwd / "runs/sentiment").mkdir(parents=True, exist_ok=True)
    link = cwd / "runs/sentiment/exported"
    if not link.exists():
        link.symlink_to(export.absolute())
    (cwd / "block.py").write_text(DOCS_BLOCK.group(1))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return subprocess.run([str(python), "-c", _ONLY_NAMED_RUNNER, "block.py", json.dumps(_named_distributions())],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _result(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT ")[-1])
    assert result["blocked_loaded"] == []
    return result


@pytest.mark.slow  # a subprocess
def test_the_docs_block_runs_with_only_the_packages_the_docs_install(exported, tmp_path):
    """What a venv of the docs' `pip install` line holds, here: a module of any other installed
    distribution (flatbuffers, unless the line names it) raises ImportError."""
    probs = np.array(_result(_run_docs_block(exported, tmp_path))["probs"])
    assert probs.shape == (2, 2) and np.allclose(probs.sum(1), 1.0, atol=1e-5)
    from train.export import LOADER_PACKAGES  # what the export command's last line names

    assert DOCS_INSTALL is not None and DOCS_INSTALL.group(1).split() == list(LOADER_PACKAGES)


@pytest.mark.slow
def test_the_docs_block_runs_in_a_fresh_venv_of_the_docs_install_line(exported, tmp_path, capsys):
    """A new venv (python -m venv), then the docs' `pip install ...` line as written (from PyPI or the pip
    cache: this test needs one of them), then the docs block in that venv's python: it runs and gives
    predict's labels."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    assert DOCS_INSTALL is not None
    pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          *DOCS_INSTALL.group(1).split()], capture_output=True, text=True, timeout=1200)
    assert pip.returncode == 0, pip.stderr[-3000:]
    (tmp_path / "cwd").mkdir()
    done = _run_docs_block(exported, tmp_path / "cwd", venv / "bin/python")
    result = _result(done)
    capsys.readouterr()
    assert main(["predict", "--workdir", str(exported.parent), "--json", *TEXTS]) == 0
    predicted = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    shown = [line.split("\t") for line in done.stdout.splitlines() if "\t" in line]
    assert [row[0] for row in shown] == [p["label"] for p in predicted]
    assert np.array(result["probs"]).shape == (2, 2)


@pytest.mark.slow
def test_docs_block_loads_the_export_without_model_code_and_equals_predict(exported, tmp_path, capsys):
    assert DOCS_BLOCK is not None and len(DOCS_BLOCK.group(1).strip().splitlines()) <= 15
    manifest = json.loads((exported / "manifest.json").read_text())
    assert manifest["platforms"] == ["cpu", "cuda", "tpu"] and manifest["attention"]["kernel"] == "xla"
    assert manifest["constraints"] == ["b >= 1", "1 <= l <= 16"]
    assert set(manifest["files"]) == {"model.jax", "params.safetensors", "tokenizer.json"}
    done = _run_docs_block(exported, tmp_path)
    result = _result(done)
    shown = [line.split("\t") for line in done.stdout.splitlines() if "\t" in line]
    assert [row[2] for row in shown] == TEXTS

    capsys.readouterr()
    assert main(["predict", "--workdir", str(exported.parent), "--json", *TEXTS]) == 0
    predicted = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = np.array([[p["probabilities"][name] for name in manifest["labels"]] for p in predicted])
    got = np.array(result["probs"])
    assert np.abs(got - want).max() < 1e-6, (got, want)
    assert [row[0] for row in shown] == [p["label"] for p in predicted]


def _damaged_copy(exported: Path, tmp_path: Path) -> Path:
    """The export with one byte of its parameters flipped."""
    damaged = tmp_path / "damaged"
    shutil.copytree(exported, damaged)
    params = damaged / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[-5] ^= 0xFF
    params.write_bytes(bytes(data))
    return damaged


def test_a_damaged_export_is_refused_in_one_line(exported, tmp_path):
    from train.serving.artifact import Artifact

    damaged = _damaged_copy(exported, tmp_path)
    with pytest.raises(CheckpointError, match=r"params\.safetensors fails its SHA-256 check") as err:
        Artifact.load(damaged)
    assert "\n" not in str(err.value)
    (damaged / "model.jax").unlink()
    with pytest.raises(CheckpointError, match=r"model\.jax is unreadable"):
        Artifact.load(damaged)
    with pytest.raises(CheckpointError, match=r"holds no export"):
        Artifact.load(tmp_path)


@pytest.mark.slow
def test_the_docs_block_refuses_a_damaged_export_in_one_line(exported, tmp_path):
    """The same refusal where a user meets it: the docs block, in a fresh interpreter without model code."""
    done = _run_docs_block(_damaged_copy(exported, tmp_path), tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "params.safetensors fails its SHA-256 check" in done.stderr


def test_symbolic_batch_and_length_within_max_len(exported):
    from train.serving.artifact import Artifact

    artifact = Artifact.load(exported)
    for b, n in ((1, 1), (3, 16)):
        out = artifact.run(np.ones((b, n), np.int32), np.ones((b, n), np.int32))
        assert out["probabilities"].shape == (b, 2) and out["embeddings"].shape == (b, 32)
        np.testing.assert_allclose(out["probabilities"].sum(-1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match=r"1 <= l <= 16"):
        artifact.run(np.ones((1, 17), np.int32), np.ones((1, 17), np.int32))
    # Padding is invisible: the same rows padded further give the same outputs.
    tokens = np.array([[2, 3, 4, 0]], np.int32)
    mask = np.array([[1, 1, 1, 0]], np.int32)
    short = artifact.run(tokens[:, :3], mask[:, :3])["logits"]
    padded = artifact.run(np.pad(tokens, ((0, 0), (0, 8)), constant_values=7), np.pad(mask, ((0, 0), (0, 8))))
    np.testing.assert_allclose(short, padded["logits"], atol=1e-6)


@pytest.mark.parametrize("case", ["no checkpoints", "missing workdir", "platform", "unwritable", "not an export",
                                  "both sources"])
def test_bad_input_is_one_line_exit_2_and_nothing_left(exported, tmp_path, capsys, case):
    workdir = exported.parent
    blocker = tmp_path / "file"
    blocker.write_text("x")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    argv = {"no checkpoints": ["--workdir", str(other)],
            "missing workdir": ["--workdir", str(tmp_path / "nowhere")],
            "platform": ["--workdir", str(workdir), "--platforms", "cpu,metal", "--out", str(tmp_path / "o")],
            "unwritable": ["--workdir", str(workdir), "--out", str(blocker / "sub")],
            "not an export": ["--workdir", str(workdir), "--out", str(other)],
            "both sources": ["--workdir", str(workdir), "--model", "hf:x", "--out", str(tmp_path / "o")]}[case]
    capsys.readouterr()
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "other"]
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]


def test_a_failed_export_leaves_nothing_and_keeps_the_previous_one(exported, tmp_path, monkeypatch, capsys):
    from train import export

    out = tmp_path / "exp"
    shutil.copytree(exported, out)
    before = (out / "manifest.json").read_bytes()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_params", broken)
    assert main(["export", "--workdir", str(exported.parent), "--out", str(out), "--platforms", "cpu"]) == 2
    assert "disk full while writing the export" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no partial directory beside it
    assert (out / "manifest.json").read_bytes() == before


# --- the tokenizer ------------------------------------------------------------------------------

_TEXT = st.text(st.characters(codec="utf-8"), max_size=60)


def _same_ids(ours, max_len: int, texts: list[str]) -> None:
    from train.data.tokenizer import truncate
    from train.export_tokenizer import exported_tokenizer

    hf = exported_tokenizer(ours, max_len)
    encodings = hf.encode_batch(texts)
    for text, enc in zip(texts, encodings, strict=True):
        full = ours.encode(text)
        want = truncate(ours, full, max_len)
        assert enc.ids[: sum(enc.attention_mask)] == want, text
        assert bool(enc.overflowing) == (len(full) > max_len), text
        assert all(i == ours.pad_id for i, m in zip(enc.ids, enc.attention_mask, strict=True) if not m)


@settings(max_examples=60, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=4))
def test_exported_byte_and_bpe_tokenizers_give_the_runs_ids(texts):
    from train.data.tokenizer import ByteTokenizer

    _same_ids(ByteTokenizer(), 24, texts)
    _same_ids(_bpe(), 12, texts)


_BPE: list = []


def _bpe():
    from train.data.tokenizer import BpeTokenizer

    if not _BPE:
        _BPE.append(BpeTokenizer.train(["a gripping, funny film", "dull and overlong", "ünïcödé ✓ text"] * 5, 300))
    return _BPE[0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 20).map(str) | st.sampled_from(["x", "-1", ""]), max_size=20)
                .map(" ".join), min_size=1, max_size=4))
def test_exported_id_tokenizer_gives_the_runs_ids(texts):
    from train.data.tokenizer import IdTokenizer

    _same_ids(IdTokenizer(16), 16, texts)


def test_exported_pretrained_tokenizer_keeps_the_closing_token_when_it_truncates(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from train.data.tokenizer import PretrainedTokenizer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(SYMBOL_TEXTS, trainers.WordPieceTrainer(
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    ours = PretrainedTokenizer(tok, 0)
    texts = [SYMBOL_TEXTS[0], "3 4", "", " ".join(["5"] * 30)]
    _same_ids(ours, 10, texts)


# --- a pretrained checkpoint's embeddings, and the transformers directory -----------------------


@pytest.mark.slow
def test_export_of_a_transformers_checkpoint_gives_embeds_vectors(tmp_path):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from tests.conftest import random_bert_dir
    from train.embed import embed
    from train.serving.artifact import Artifact

    path = random_bert_dir(tmp_path / "bert")
    assert main(["export", "--model", f"hf:{path}", "--out", str(tmp_path / "exp"), "--platforms", "cpu"]) == 0
    artifact = Artifact.load(tmp_path / "exp")
    assert artifact.kind == "encoder" and artifact.outputs == ["embeddings"]
    texts = ["3 4 5", SYMBOL_TEXTS[1]]
    rows = Tokenizer.from_file(str(tmp_path / "exp/tokenizer.json")).encode_batch(texts)  # padded as shipped
    tokens = np.array([r.ids for r in rows], np.int32)
    mask = np.array([r.attention_mask for r in rows], np.int32)
    np.testing.assert_allclose(artifact.run(tokens, mask)["embeddings"], embed(texts, f"hf:{path}"), atol=2e-5)


@pytest.mark.slow
def test_format_hf_gives_transformers_our_predictions(tmp_path):
    pytest.importorskip("transformers")
    import torch
    import transformers

    from jaxblock import Classifier
    from jaxblock.interop.hf import from_hf
    from tests.conftest import random_bert_dir
    from train.data.labelled import encode_texts
    from train.export_hf import write_hf_dir
    from train.init_from.hf import hf_source

    path = random_bert_dir(tmp_path / "bert")
    source = hf_source(f"hf:{path}")
    config = source.model.model_copy(update={"num_classes": 3, "max_len": 16})
    _, encoder = from_hf(path, max_len=16)
    model = Classifier(config)
    tokens = jax.numpy.ones((1, 4), jax.numpy.int32)
    params = model.init(jax.random.key(0), tokens, tokens > 0)["params"]
    params = jax.tree.map(np.asarray, {**params, "encoder": encoder["params"]})
    labels = ["low", "mid", "high"]
    write_hf_dir(config, params, source.tokenizer, labels, 16, tmp_path / "hf")

    hf_model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_model.config.id2label == {0: "low", 1: "mid", 2: "high"}
    texts = ["3 4 5", SYMBOL_TEXTS[2]]
    batch = hf_tok(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        theirs = torch.softmax(hf_model(**batch).logits, -1).numpy()
    ours_batch = encode_texts(source.tokenizer, texts, 16, [16])
    real = batch["attention_mask"].numpy().astype(bool)
    assert [list(row[m]) for row, m in zip(batch["input_ids"].numpy(), real, strict=True)] == \
        [list(row[m]) for row, m in zip(ours_batch["tokens"], ours_batch["valid_tokens"], strict=True)]
    ours = jax.nn.softmax(model.apply({"params": params}, ours_batch["tokens"], ours_batch["valid_tokens"]), -1)
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-5)


# --- the real runs (slow) -----------------------------------------------------------------------


def _train_cli(*args: str, cwd: Path | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "train", *args, "train.progress=false"], capture_output=True,
                          text=True, timeout=1800, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_the_main_job_exported_with_the_defaults_loads_in_the_docs_block_and_equals_predict(tmp_path, capsys):
    """The docs block as written (runs/sentiment/exported) on the main job's config, trained for 100 steps."""
    workdir = tmp_path / "runs/sentiment"
    _train_cli("--config", str(ROOT / "configs/sentiment.yaml"), "--workdir", str(workdir), "train.steps=100",
               "train.eval_every=100", "checkpoint.every=100")
    _export(workdir)
    result = _result(_run_docs_block(workdir / "exported", tmp_path))
    capsys.readouterr()
    assert main(["predict", "--workdir", str(workdir), "--json", *TEXTS]) == 0
    predicted = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    labels = json.loads((workdir / "exported/manifest.json").read_text())["labels"]
    want = np.array([[p["probabilities"][name] for name in labels] for p in predicted])
    assert np.abs(np.array(result["probs"]) - want).max() < 1e-6


@pytest.mark.slow
def test_the_pretrained_job_as_a_transformers_directory_predicts_as_we_do(tmp_path):
    """configs/sentiment_pretrained.yaml (all-MiniLM-L6-v2, fetched once) fine-tuned for 20 steps, written with
    --format hf: AutoModelForSequenceClassification and AutoTokenizer give our probabilities on test sentences."""
    pytest.importorskip("transformers")
    import torch
    import transformers

    from bench.serve_load import test_texts
    from train.inference import TrainedRun

    workdir = tmp_path / "run"
    _train_cli("--config", str(ROOT / "configs/sentiment_pretrained.yaml"), "--workdir", str(workdir),
               "train.steps=20", "train.eval_every=20", "checkpoint.every=20", "optim.warmup_steps=2")
    assert main(["export", "--workdir", str(workdir), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    texts = test_texts(workdir)[:200]
    run = TrainedRun.load(workdir)
    ours = np.array([[p.probabilities[name] for name in run.label_names] for p in run.predict(texts)])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [model.config.id2label[i] for i in range(2)] == run.label_names
    with torch.no_grad():
        batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        theirs = torch.softmax(model(**batch).logits, -1).numpy()
    assert np.abs(theirs - ours).max() < 1e-4
    assert (theirs.argmax(1) == ours.argmax(1)).all()
