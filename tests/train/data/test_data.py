"""train/data/ (labelled.py, tokenizer.py, datasets.py): tokenizers, sources, split, batches, packing."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

from train.config import DataConfig
from train.data import datasets as sources
from train.data.datasets import synthetic_examples
from train.data.labelled import (
    BpeTokenizer,
    ByteTokenizer,
    DataError,
    IdTokenizer,
    Split,
    encode_texts,
    eval_batches,
    load_dataset,
    load_tokenizer,
    pack_examples,
    train_batch,
    unpack_examples,
)

BUCKETS = [8, 16, 32]


def one_line_error(fn, *args, match: str, **kwargs) -> str:
    with pytest.raises(DataError, match=match) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and ":" in msg, msg  # one line: the problem, then the fix
    return msg


def toy_split(lengths: list[int], seed: int = 0) -> Split:
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(3, 50, size=n).astype(np.int32) for n in lengths]
    return Split(tokens, np.arange(len(lengths), dtype=np.int32) % 3, [f"t{i}" for i in range(len(lengths))])


# --- tokenizers --------------------------------------------------------------------------------

CORPUS = [f"the film number {i} was {w} and {v}" for i in range(150)
          for w, v in [("great", "moving"), ("dull", "slow")]]


def test_byte_tokenizer_round_trip_and_save_load(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ 😀"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and min(ids) >= 3 and max(ids) < tok.vocab_size == 259
    assert tok.encode("A") == [ord("A") + 3] and tok.pad_id == 0
    assert tok.decode(ids) == text
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteTokenizer) and loaded.encode(text) == ids


def test_bpe_tokenizer_trains_round_trips_and_reloads(tmp_path: Path) -> None:
    tok = BpeTokenizer.train(CORPUS, vocab_size=300)
    assert tok.pad_id == 0 and 256 < tok.vocab_size <= 300
    for text in ["the film was great", "an unseen wörd 😀"]:
        ids = tok.encode(text)
        assert all(0 < i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # Merges learned from the corpus make frequent words single tokens.
    assert len(tok.encode("the film was great")) < len("the film was great") // 2
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BpeTokenizer) and loaded.vocab_size == tok.vocab_size
    assert loaded.encode("the film was dull and slow") == tok.encode("the film was dull and slow")


def test_id_tokenizer_round_trip_unknown_and_reload(tmp_path: Path) -> None:
    tok = IdTokenizer(10)
    assert tok.vocab_size == 12
    assert tok.encode("0 9 3") == [2, 11, 5]
    assert tok.encode("10 x -1") == [1, 1, 1]  # out of range or not a symbol -> unk
    assert tok.decode([2, 11, 5, 0, 0]) == "0 9 3"
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, IdTokenizer) and loaded.symbols == 10


def test_load_tokenizer_errors_are_one_line(tmp_path: Path) -> None:
    one_line_error(load_tokenizer, tmp_path / "absent", match="no tokenizer in")
    BpeTokenizer.train(CORPUS, 300).save(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    one_line_error(load_tokenizer, tmp_path, match="unreadable")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"kind": "wordpiece"}))
    one_line_error(load_tokenizer, tmp_path, match="unknown kind 'wordpiece'")


# --- batches -----------------------------------------------------------------------------------


def test_train_batch_is_a_pure_function_of_seed_and_step() -> None:
    split = toy_split([3 + i % 20 for i in range(50)])
    kw = dict(seed=7, batch_size=10, buckets=BUCKETS)
    a = train_batch(split, step=3, **kw)
    b = train_batch(split, step=3, **kw)  # a fresh call, after other steps ran in between
    train_batch(split, step=0, **kw)
    c = train_batch(split, step=3, **kw)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        np.testing.assert_array_equal(a[k], c[k])
    other = train_batch(split, step=4, **kw)
    assert not np.array_equal(a["labels"], other["labels"]) or not np.array_equal(a["tokens"], other["tokens"])
    reseeded = train_batch(split, step=3, **{**kw, "seed": 8})
    assert not np.array_equal(a["tokens"], reseeded["tokens"])


def _row_ids(batch: dict[str, np.ndarray], split: Split) -> list[int]:
    # The toy split's rows are distinct, so a row's tokens identify its example.
    index = {tuple(t.tolist()): i for i, t in enumerate(split.tokens)}
    rows = zip(batch["tokens"], batch["valid_tokens"], strict=True)
    return [index[tuple(row[valid].tolist())] for row, valid in rows]


@pytest.mark.parametrize("batch_size", [10, 16])
def test_each_epoch_visits_every_example_once(batch_size: int) -> None:
    split = toy_split([4 + i % 25 for i in range(50)])
    assert len({tuple(t.tolist()) for t in split.tokens}) == 50
    seen: list[int] = []
    for step in range(4 * 50 // batch_size):  # whole batches spanning 4 epochs (16 straddles epoch ends)
        batch = train_batch(split, seed=1, step=step, batch_size=batch_size, buckets=BUCKETS)
        ids = _row_ids(batch, split)
        np.testing.assert_array_equal(batch["labels"], split.labels[ids])
        seen += ids
    epochs = [seen[e * 50:(e + 1) * 50] for e in range(len(seen) // 50)]
    assert len(epochs) >= 3
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))
    assert epochs[0] != epochs[1]  # each epoch has its own order


def test_process_shares_concatenate_to_the_global_batch() -> None:
    split = toy_split([1 + (i * 7) % 30 for i in range(40)])
    kw = dict(seed=3, step=5, batch_size=16, buckets=BUCKETS)
    whole = train_batch(split, **kw)
    for count in (2, 4, 8):
        shares = [train_batch(split, process_index=p, process_count=count, **kw) for p in range(count)]
        assert {s["tokens"].shape for s in shares} == {(16 // count, whole["tokens"].shape[1])}
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([s[k] for s in shares]), whole[k])
    one_line_error(train_batch, split, process_index=0, process_count=3, match="multiple of the process count", **kw)


def test_bucket_padding_and_left_aligned_valid_tokens() -> None:
    split = toy_split([2, 5, 9, 3, 16, 1, 7, 4] * 4)
    for step in range(8):
        batch = train_batch(split, seed=0, step=step, batch_size=4, buckets=BUCKETS)
        tokens, valid = batch["tokens"], batch["valid_tokens"]
        assert tokens.dtype == np.int32 and valid.dtype == np.bool_ and batch["labels"].dtype == np.int32
        lengths = valid.sum(1)
        longest = lengths.max()
        assert tokens.shape[1] == min(b for b in BUCKETS if b >= longest)
        assert np.all(valid[:, :-1] | ~valid[:, 1:])  # real tokens first, padding only at the end
        assert np.all(tokens[~valid] == 0) and np.all(tokens[valid] >= 3)
    one_line_error(train_batch, toy_split([40]), seed=0, step=0, batch_size=1, buckets=BUCKETS,
                   match="exceeds the largest bucket 32")


def test_eval_batches_cover_the_split_once_with_padding_rows() -> None:
    split = toy_split([1 + i % 11 for i in range(23)])
    batches = list(eval_batches(split, batch_size=8, buckets=BUCKETS))
    assert [b["tokens"].shape[0] for b in batches] == [8, 8, 8]
    labels = np.concatenate([b["labels"] for b in batches])
    np.testing.assert_array_equal(labels[:23], split.labels)
    np.testing.assert_array_equal(labels[23:], [-1])
    last = batches[-1]
    assert not last["valid_tokens"][-1].any() and last["valid_tokens"][:-1].any(1).all()
    rows = [r[v] for b in batches for r, v in zip(b["tokens"], b["valid_tokens"], strict=True)][:23]
    for got, want in zip(rows, split.tokens, strict=True):
        np.testing.assert_array_equal(got, want)
    shares = [list(eval_batches(split, batch_size=8, buckets=BUCKETS, process_index=p, process_count=2))
              for p in range(2)]
    for i, whole in enumerate(batches):
        np.testing.assert_array_equal(np.concatenate([shares[0][i]["tokens"], shares[1][i]["tokens"]]),
                                      whole["tokens"])


def test_encode_texts_for_predict() -> None:
    batch = encode_texts(ByteTokenizer(), ["good", "a much longer text here"], max_len=10, buckets=BUCKETS)
    assert batch["tokens"].shape == (2, 16)  # 10 kept tokens -> bucket 16
    np.testing.assert_array_equal(batch["valid_tokens"].sum(1), [4, 10])
    np.testing.assert_array_equal(batch["labels"], [-1, -1])
    one_line_error(encode_texts, ByteTokenizer(), ["fine", ""], 10, BUCKETS, match="text 2 is empty")
    one_line_error(encode_texts, ByteTokenizer(), [], 10, BUCKETS, match="no text")


# --- local files -------------------------------------------------------------------------------


def file_cfg(path: Path, **kw) -> DataConfig:
    return DataConfig(**{"source": "file", "path": str(path), "max_len": 32, "buckets": BUCKETS, **kw})


def write_rows(path: Path, count: int = 30) -> Path:
    rows = [(f'review {i}, "quoted" text', ["neg", "pos", "neutral"][i % 3]) for i in range(count)]
    if path.suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"text": t, "label": lb, "extra": 1}) for t, lb in rows) + "\n")
    elif path.suffix == ".tsv":
        path.write_text("label\ttext\n" + "".join(f"{lb}\t{t}\n" for t, lb in rows))
    else:
        path.write_text("id,text,label\r\n" + "".join(f'{i},"{t.replace(chr(34), 2 * chr(34))}",{lb}\r\n'
                                                    for i, (t, lb) in enumerate(rows)))
    return path


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_file_formats_load_the_same_examples(tmp_path: Path, suffix: str) -> None:
    ds = load_dataset(file_cfg(write_rows(tmp_path / f"data{suffix}")))
    assert ds.label_names == ["neg", "neutral", "pos"]  # sorted distinct
    assert (len(ds.train), len(ds.validation), len(ds.test)) == (24, 3, 3)
    texts = ds.train.texts + ds.validation.texts + ds.test.texts
    labels = np.concatenate([ds.train.labels, ds.validation.labels, ds.test.labels])
    assert sorted(texts) == sorted(f'review {i}, "quoted" text' for i in range(30))
    for text, label in zip(texts, labels, strict=True):
        i = int(text.split()[1].rstrip(","))
        assert ds.label_names[label] == ["neg", "pos", "neutral"][i % 3]
    for split in (ds.train, ds.validation, ds.test):
        for text, toks in zip(split.texts, split.tokens, strict=True):
            np.testing.assert_array_equal(toks, ByteTokenizer().encode(text)[:32])


def test_split_is_fixed_by_split_seed_and_counts_truncation(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.csv")
    a, b = load_dataset(file_cfg(path)), load_dataset(file_cfg(path))
    assert a.test.texts == b.test.texts and a.train.texts == b.train.texts
    assert load_dataset(file_cfg(path, split_seed=1)).test.texts != a.test.texts
    short = load_dataset(file_cfg(path, max_len=23))
    for name in ("train", "validation", "test"):
        split = getattr(short, name)
        assert short.truncated[name] == sum(len(t.encode()) > 23 for t in split.texts)
        assert max(len(t) for t in split.tokens) == 23
    assert sum(short.truncated.values()) == 20  # rows 10-29 are 24 bytes, rows 0-9 fit in 23
    assert "truncated" in short.summary()


def test_given_labels_fix_the_class_order(tmp_path: Path) -> None:
    ds = load_dataset(file_cfg(write_rows(tmp_path / "d.jsonl"), labels=["pos", "neg", "neutral"]))
    assert ds.label_names == ["pos", "neg", "neutral"]
    i = ds.train.texts.index('review 4, "quoted" text')
    assert ds.train.labels[i] == 0  # row 4 is "pos"
    numeric = tmp_path / "n.csv"
    numeric.write_text("text,label\n" + "".join(f"t{i},{[2, 10, 1][i % 3]}\n" for i in range(12)))
    assert load_dataset(file_cfg(numeric)).label_names == ["1", "2", "10"]


@pytest.mark.parametrize(
    ("name", "content", "kw", "match"),
    [
        ("absent.csv", None, {}, "absent.csv not found"),
        ("empty.csv", "", {}, "empty.csv is empty"),
        ("header.csv", "text,label\n", {}, "no examples"),
        ("fields.csv", "text,label\na,pos\nb,neg,extra\n", {}, "fields.csv line 3: 3 fields"),
        ("quote.csv", 'text,label\n"a"b",pos\n', {}, "quote.csv line 2: malformed row"),
        ("column.csv", "body,label\na,pos\n", {}, "no column 'text' \\(columns: body, label\\)"),
        ("column.tsv", "text\tstars\na\t1\n", {}, "set data.label_column"),
        ("outside.csv", "text,label\na,pos\nb,meh\n", {"labels": ["neg", "pos"]}, "outside.csv line 3: label 'meh'"),
        ("blank.csv", "text,label\n ,pos\n", {}, "blank.csv line 2: empty text"),
        ("single.csv", "text,label\na,pos\nb,pos\n", {}, "at least 2 classes"),
        ("bad.jsonl", '{"text": "a", "label": 1}\n{"text": \n', {}, "bad.jsonl line 2: not valid JSON"),
        ("list.jsonl", "[1, 2]\n", {}, "list.jsonl line 1: a JSON list"),
        ("key.jsonl", '{"text": "a"}\n', {}, "key.jsonl line 1 has no key 'label'"),
        ("data.txt", "text,label\na,b\n", {}, "set data.format"),
        ("latin.csv", b"text,label\ncaf\xe9,pos\n", {}, "not UTF-8"),
    ],
)
def test_file_errors_are_one_line_naming_file_and_place(tmp_path: Path, name, content, kw, match) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    msg = one_line_error(load_dataset, file_cfg(path, **kw), match=match)
    assert name in msg


def test_too_few_examples_for_the_split(tmp_path: Path) -> None:
    path = tmp_path / "tiny.csv"
    path.write_text("text,label\na,x\nb,y\nc,x\n")
    one_line_error(load_dataset, file_cfg(path), match="leave a split empty")


def test_tokenizer_dir_reuses_the_runs_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("text,label\n" + "".join(f"{CORPUS[i]},{i % 2}\n" for i in range(200)))
    cfg = file_cfg(path, tokenizer="bpe", bpe_vocab_size=300)
    first = load_dataset(cfg, tmp_path / "run")  # nothing saved yet: trains on the train split
    assert isinstance(first.tokenizer, BpeTokenizer)
    assert not (tmp_path / "run").exists()  # load_dataset writes nothing
    first.tokenizer.save(tmp_path / "run")
    again = load_dataset(cfg.model_copy(update={"bpe_vocab_size": 400}), tmp_path / "run")
    assert again.tokenizer.vocab_size == first.tokenizer.vocab_size  # loaded, not retrained
    for x, y in zip(first.test.tokens, again.test.tokens, strict=True):
        np.testing.assert_array_equal(x, y)
    one_line_error(load_dataset, cfg.model_copy(update={"tokenizer": "byte"}), tmp_path / "run",
                   match="tokenizer in .* is 'bpe' but the config asks for 'byte'")
    one_line_error(load_dataset, file_cfg(path, max_len=64), match="max_len=64 exceeds the largest bucket 32")


# --- synthetic tasks ---------------------------------------------------------------------------


def _rows(task: str, size: int, seed: int = 0, vocab: int = 16, length: int = 20) -> tuple[np.ndarray, np.ndarray]:
    ex = synthetic_examples(task, size, vocab, length, seed)
    return np.asarray([[int(w) for w in t.split()] for t in ex.texts]), ex.labels


@pytest.mark.parametrize("task", ["pair_match", "majority"])
def test_synthetic_labels_follow_the_rule_and_are_balanced(task: str) -> None:
    rows, labels = _rows(task, 400)
    assert rows.shape == (400, 20) and rows.min() >= 0 and rows.max() < 16
    assert labels.sum() == 200
    for row, label in zip(rows, labels, strict=True):
        counts = np.bincount(row, minlength=16)
        if task == "pair_match":
            assert label == (row[0] in row[1:])
        else:
            assert label == (counts[row[0]] == counts.max() and (counts == counts.max()).sum() == 1)
    again, _ = _rows(task, 400)
    np.testing.assert_array_equal(rows, again)
    assert not np.array_equal(rows, _rows(task, 400, seed=1)[0])


@pytest.mark.parametrize("task", ["pair_match", "majority"])
def test_token_counts_carry_no_signal_but_position_zero_does(task: str) -> None:
    from sklearn.linear_model import LogisticRegression

    rows, labels = _rows(task, 6000, vocab=32, length=32)
    counts = np.stack([np.bincount(r, minlength=32) for r in rows])  # [E, V] bag of tokens
    train, test = slice(0, 4800), slice(4800, None)
    bag = LogisticRegression(max_iter=2000).fit(counts[train], labels[train])
    chance_acc = bag.score(counts[test], labels[test])
    assert abs(chance_acc - 0.5) < 0.06, chance_acc  # 1200 test rows: chance is 0.5 +- 0.015
    # The same learner given one relational feature (how often the first token occurs) is near perfect:
    # the signal is there, only a model that relates position 0 to the rest can reach it.
    first = counts[np.arange(len(rows)), rows[:, 0]]
    feats = np.stack([first, first == counts.max(1)], 1).astype(float)
    relational = LogisticRegression(max_iter=2000).fit(feats[train], labels[train])
    assert relational.score(feats[test], labels[test]) > 0.97


def test_synthetic_dataset_uses_the_id_tokenizer(tmp_path: Path) -> None:
    cfg = DataConfig(synthetic_size=200, synthetic_vocab=8, synthetic_len=12, max_len=16, buckets=[16])
    ds = load_dataset(cfg)
    assert isinstance(ds.tokenizer, IdTokenizer) and ds.tokenizer.vocab_size == 10
    assert all(len(t) == 12 and t.min() >= 2 and t.max() < 10 for t in ds.train.tokens)
    ds.tokenizer.save(tmp_path)
    one_line_error(load_dataset, cfg.model_copy(update={"synthetic_vocab": 9}), tmp_path, match="8 symbols")


# --- packing -----------------------------------------------------------------------------------


def test_packing_keeps_segments_consistent_and_unpacks_every_example() -> None:
    split = toy_split([1 + (i * 13) % 30 for i in range(101)] + [32])
    packed = pack_examples(split.tokens, split.labels, row_len=32, max_segments=4)
    tokens, valid, seg, labels, index = (packed[k] for k in
                                         ("tokens", "valid_tokens", "segment_ids", "labels", "example_index"))
    n = tokens.shape[0]
    assert tokens.shape == valid.shape == seg.shape == (n, 32) and labels.shape == index.shape == (n, 4)
    assert seg.dtype == labels.dtype == tokens.dtype == np.int32
    total = sum(len(t) for t in split.tokens)
    assert -(-total // 32) <= n < len(split)  # at least the token bound, fewer rows than examples
    assert valid.mean() > 0.85  # best-fit packing wastes little
    np.testing.assert_array_equal(valid, seg >= 0)
    assert np.all(valid[:, :-1] | ~valid[:, 1:]) and np.all(tokens[~valid] == 0)
    for r in range(n):
        used = index[r] >= 0
        k = int(used.sum())
        assert k >= 1 and np.all(used[:k]) and not used[k:].any()  # slots filled first
        np.testing.assert_array_equal(labels[r][~used], -1)
        np.testing.assert_array_equal(labels[r][used], split.labels[index[r][used]])
        ids = seg[r][valid[r]]
        assert np.all(np.diff(ids) >= 0) and set(ids.tolist()) == set(range(k))  # contiguous 0..k-1
    recovered = unpack_examples(packed)
    assert sorted(recovered) == list(range(len(split)))
    for i, (toks, label) in recovered.items():
        np.testing.assert_array_equal(toks, split.tokens[i])
        assert label == split.labels[i]
    one_line_error(pack_examples, split.tokens, split.labels, row_len=16, max_segments=4, match="does not fit")


def test_packing_respects_max_segments() -> None:
    split = toy_split([2] * 40)
    packed = pack_examples(split.tokens, split.labels, row_len=32, max_segments=3)
    assert packed["tokens"].shape == (14, 32) and (packed["example_index"] >= 0).sum() == 40


# --- the vaderSentiment ground truth, offline ---------------------------------------------------

FAKE_ROWS = {
    "movieReviewSnippets_GroundTruth.txt": [("1", "2.25", "A rich, moving film ; café"), ("2", "-1.5", "Dull."),
                                            ("3", "0", "Exactly neutral."), ("4", "0.05", "Barely good")],
    "tweets_GroundTruth.txt": [("1", "1.0", "yay"), ("2", "-2.0", "ugh")],
    "amazonReviewSnippets_GroundTruth.txt": [("1_1", "-0.9", "broke"), ("1_2", "0.0", "ok")],
    "nytEditorialSnippets_GroundTruth.txt": [("1_1", "0.4", "a fine plan"), ("1_2", "-0.2", "a poor plan")],
}


def fake_sdist(directory: Path, rows: dict[str, list[tuple[str, str, str]]] = FAKE_ROWS) -> tuple[Path, dict[str, str]]:
    """The real layout: sdist tar.gz -> additional_resources/hutto_ICWSM_2014.tar.gz -> *_GroundTruth.txt (CRLF)."""
    def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    files = {name: "".join(f"{a}\t{b}\t{c}\r\n" for a, b, c in r).encode() for name, r in rows.items()}
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tar:
        for name, data in files.items():
            add(tar, f"hutto_ICWSM_2014/{name}", data)
        add(tar, "hutto_ICWSM_2014/_README_.txt", b"readme")
    path = directory / "vaderSentiment-3.3.2.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        add(tar, "vaderSentiment-3.3.2/setup.py", b"")
        add(tar, "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz", inner.getvalue())
    return path, {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


@pytest.fixture
def fake_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Route the pip fetch to a fake sdist; returns the list of fetches made."""
    fetched: list[Path] = []
    build = tmp_path / "build"
    build.mkdir()
    _, digests = fake_sdist(build)
    for name, digest in digests.items():
        monkeypatch.setitem(sources.VADER_SHA256, name, digest)

    def fetch(directory: Path) -> Path:
        fetched.append(directory)
        return fake_sdist(directory)[0]

    monkeypatch.setattr(sources, "pip_download", fetch)
    return fetched


def test_vader_archive_is_parsed_cached_and_verified(tmp_path: Path, fake_registry: list[Path]) -> None:
    cache = tmp_path / "cache"
    ex = sources.load_vader("rotten_tomatoes", cache)
    assert ex.texts == ["A rich, moving film ; café", "Dull.", "Barely good"]  # rated exactly 0: dropped
    np.testing.assert_array_equal(ex.labels, [1, 0, 1])
    assert ex.label_names == ["negative", "positive"]
    assert len(fake_registry) == 1 and sorted(p.name for p in (cache / "vader_3.3.2").iterdir()) == sorted(FAKE_ROWS)
    assert sources.load_vader("amazon", cache).texts == ["broke"]  # same archive, no second fetch
    assert len(fake_registry) == 1
    (cache / "vader_3.3.2" / "tweets_GroundTruth.txt").write_text("1\t1.0\ttampered\r\n")
    assert sources.load_vader("tweets", cache).texts == ["yay", "ugh"]  # a corrupt cache is fetched again
    assert len(fake_registry) == 2


def test_vader_dataset_through_load_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake archive with enough NYT rows that every split is non-empty.
    rows = {**FAKE_ROWS, "nytEditorialSnippets_GroundTruth.txt": [
        (f"1_{i}", f"{(-1) ** i * 0.5}", f"plan number {i}") for i in range(20)]}
    for name, digest in fake_sdist(tmp_path, rows)[1].items():
        monkeypatch.setitem(sources.VADER_SHA256, name, digest)
    monkeypatch.setattr(sources, "pip_download", lambda d: fake_sdist(d, rows)[0])
    ds = load_dataset(DataConfig(source="nyt", cache_dir=str(tmp_path / "c"), max_len=32, buckets=BUCKETS))
    assert (len(ds.train), len(ds.validation), len(ds.test)) == (16, 2, 2)
    assert ds.label_names == ["negative", "positive"]
    for split in (ds.train, ds.validation, ds.test):
        for text, label in zip(split.texts, split.labels, strict=True):
            assert label == (int(text.split()[-1]) % 2 == 0)


def test_vader_checksum_mismatch_and_bad_archive(tmp_path: Path) -> None:
    path, digests = fake_sdist(tmp_path)
    wrong = {**digests, "tweets_GroundTruth.txt": "0" * 64}
    one_line_error(sources.extract_ground_truth, path, wrong, match="tweets_GroundTruth.txt .* fails its SHA-256")
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tarball")
    one_line_error(sources.extract_ground_truth, bad, digests, match="not a readable archive")
    gt = tmp_path / "gt.txt"
    gt.write_bytes(b"1\t0.5\tfine\r\n2\tnot-a-number\tbroken\r\n")
    one_line_error(sources.parse_ground_truth, gt, match="gt.txt line 2: expected id<TAB>rating<TAB>text")


def test_pip_failures_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "vaderSentiment==3.3.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\nERROR: No matching distribution found\n")

    monkeypatch.setattr(subprocess, "run", offline)
    msg = one_line_error(sources.pip_download, tmp_path, match="pip could not fetch vaderSentiment==3.3.2")
    assert "No matching distribution found" in msg and "data.source=synthetic" in msg
    monkeypatch.undo()
    monkeypatch.setattr(sources.sys, "executable", str(tmp_path / "no-python"))
    one_line_error(sources.pip_download, tmp_path, match="could not run pip")


# --- the real download (network) ---------------------------------------------------------------


@pytest.mark.slow
def test_real_rotten_tomatoes_download_and_counts(tmp_path: Path) -> None:
    counts = {}
    for source in ("rotten_tomatoes", "tweets", "amazon", "nyt"):
        ex = sources.load_vader(source, tmp_path)
        counts[source] = (int((ex.labels == 0).sum()), int((ex.labels == 1).sum()))
    # 10,605 movie sentences, 37 rated exactly 0 dropped.
    assert counts == {"rotten_tomatoes": (5326, 5242), "tweets": (1299, 2897), "amazon": (1482, 2128),
                      "nyt": (2742, 2204)}
    ds = load_dataset(DataConfig(source="rotten_tomatoes", cache_dir=str(tmp_path)))
    assert (len(ds.train), len(ds.validation), len(ds.test)) == (8454, 1057, 1057)
