"""Streaming input: formats, process shares, shuffling, exact resume, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import STREAM_LINES, lines_in, stream_config, stream_tokenizer
from train.data.corpus import generate_corpus, parse_size
from train.data.corpus_blocks import CorpusBlocks, corpus_files
from train.data.datasets import DataError
from train.data.masking import MaskingSpec
from train.data.stream import BatchStream, shard_range
from train.data.tokenizer import ByteTokenizer, IdTokenizer

TOK = stream_tokenizer()


def take(stream: BatchStream, n: int) -> list[dict[str, np.ndarray]]:
    return [next(stream) for _ in range(n)]


def test_blocks_read_every_line_once_in_text_and_jsonl(numbered: Path) -> None:
    blocks = CorpusBlocks(corpus_files([str(numbered)]), block_bytes=50)
    assert blocks.formats == ["text", "jsonl"]
    seen = [int(t) for b in range(len(blocks)) for t in blocks[b]]
    assert seen == list(range(STREAM_LINES))


def test_process_shares_are_disjoint_and_cover_the_corpus(numbered: Path) -> None:
    blocks = CorpusBlocks(corpus_files([str(numbered)]), block_bytes=64)
    shares = []
    for p in range(2):
        shards = shard_range(4, p, 2)
        shares.append({int(t) for b in range(len(blocks)) if b % 4 in shards for t in blocks[b]})
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(STREAM_LINES))
    streams = [BatchStream(stream_config(numbered), TOK, process_index=p, process_count=2) for p in range(2)]
    for p, stream in enumerate(streams):  # a process's batches hold only its own lines, all of them in time
        seen = {n for b in take(stream, 60) for n in lines_in(b)}
        assert seen == shares[p]


def test_global_batch_and_masking_do_not_depend_on_the_process_count(numbered: Path) -> None:
    spec = MaskingSpec.for_tokenizer(TOK)
    whole = take(BatchStream(stream_config(numbered), TOK, masking=spec), 5)
    halves = [take(BatchStream(stream_config(numbered), TOK, process_index=p, process_count=2, masking=spec), 5)
              for p in range(2)]
    for step, batch in enumerate(whole):
        assert batch["tokens"].shape == (8, 8) and halves[0][step]["tokens"].shape == (4, 8)
        for key in ("tokens", "valid_tokens", "segment_ids", "mlm_targets", "mlm_weights"):
            np.testing.assert_array_equal(batch[key], np.concatenate([h[step][key] for h in halves]))


def test_batches_follow_the_row_convention(numbered: Path) -> None:
    batch = next(BatchStream(stream_config(numbered), TOK))
    assert batch["tokens"].dtype == np.int32 and batch["segment_ids"].dtype == np.int32
    valid, seg = batch["valid_tokens"], batch["segment_ids"]
    np.testing.assert_array_equal(valid, seg >= 0)
    assert (batch["tokens"][~valid] == TOK.pad_id).all()
    for row in valid:  # real tokens first, then padding
        assert not row[np.argmin(row):].any() or row.all()
    assert seg.max() <= 3  # max_segments=4


def test_shuffle_is_seeded(numbered: Path) -> None:
    a = [lines_in(b) for b in take(BatchStream(stream_config(numbered, seed=1), TOK), 6)]
    b = [lines_in(b) for b in take(BatchStream(stream_config(numbered, seed=1), TOK), 6)]
    c = [lines_in(b) for b in take(BatchStream(stream_config(numbered, seed=2), TOK), 6)]
    assert a == b and a != c
    flat = [n for batch in a for n in batch]
    assert flat != sorted(flat)


def test_resume_from_a_saved_state_mid_epoch_is_exact(numbered: Path) -> None:
    spec = MaskingSpec.for_tokenizer(TOK)
    stream = BatchStream(stream_config(numbered), TOK, masking=spec)
    take(stream, 13)  # mid-epoch, mid-window, mid-block
    state = json.loads(json.dumps(stream.get_state()))  # as it travels through a JSON checkpoint file
    expected = take(stream, 30)  # runs past the epoch boundary
    resumed = BatchStream(stream_config(numbered), TOK, masking=spec)
    resumed.set_state(state)
    assert resumed.step == 13
    for a, b in zip(expected, take(resumed, 30), strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_state_of_another_stream_is_refused(numbered: Path) -> None:
    state = BatchStream(stream_config(numbered), TOK).get_state()
    with pytest.raises(DataError, match="different corpus"):
        BatchStream(stream_config(numbered, seed=9), TOK).set_state(state)
    with pytest.raises(DataError, match="different corpus"):
        BatchStream(stream_config(numbered), IdTokenizer(STREAM_LINES + 1)).set_state(state)


def test_state_round_trips_through_an_orbax_checkpoint(numbered: Path, tmp_path: Path) -> None:
    import grain
    import orbax.checkpoint as ocp

    stream = BatchStream(stream_config(numbered), TOK)
    take(stream, 7)
    handlers = {"data_iter": grain.checkpoint.CheckpointHandler()}
    with ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=handlers) as manager:
        manager.save(7, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointSave(stream.orbax_item)))
        manager.wait_until_finished()
    expected = take(stream, 4)
    resumed = BatchStream(stream_config(numbered), TOK)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=handlers) as manager:
        manager.restore(7, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(resumed.orbax_item)))
    for a, b in zip(expected, take(resumed, 4), strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_array_record_corpus(tmp_path: Path) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "c.arrayrecord"), "group_size:16")
    for i in range(100):
        writer.write(str(i).encode())
    writer.close()
    blocks = CorpusBlocks([tmp_path / "c.arrayrecord"], records_per_block=8)
    assert len(blocks) == 13 and [int(t) for b in range(13) for t in blocks[b]] == list(range(100))
    seen = {n for b in take(BatchStream(stream_config(tmp_path, records_per_block=8), TOK), 30) for n in lines_in(b)}
    assert seen == set(range(100))


def test_generated_corpus_streams_as_text_and_jsonl(tmp_path: Path) -> None:
    lines = {}
    for fmt in ("text", "jsonl"):
        path = tmp_path / f"c.{fmt}"
        lines[fmt] = generate_corpus(path, 50_000, seed=3, fmt=fmt)
        assert path.stat().st_size >= 50_000 and lines[fmt] == len(path.read_text().splitlines())
        batch = next(BatchStream(stream_config(path, row_len=64, block_bytes=4096), ByteTokenizer()))
        text = ByteTokenizer().decode(batch["tokens"][0][batch["segment_ids"][0] == 0])
        assert text.endswith(" .") and "{" not in text
    assert generate_corpus(tmp_path / "again", 50_000, seed=3) == lines["text"]
    assert (tmp_path / "again").read_bytes() == (tmp_path / "c.text").read_bytes()
    assert parse_size("2GB") == 2 << 30 and parse_size("200mb") == 200 << 20


def test_globs_and_directories_list_files_in_order(numbered: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(numbered)
    assert corpus_files(["*.txt", "b.jsonl"]) == [Path("a.txt"), Path("b.jsonl")]
    assert corpus_files([str(numbered)]) == [numbered / "a.txt", numbered / "b.jsonl"]


def test_generated_corpus_has_structure_beyond_word_frequencies(tmp_path: Path) -> None:
    """A count model that sees a masked word's neighbours beats the most-frequent-word guess by far."""
    generate_corpus(tmp_path / "c", 400_000, seed=5)
    sentences = [line.split() for line in (tmp_path / "c").read_text().splitlines()]
    train, test = sentences[: len(sentences) * 4 // 5], sentences[len(sentences) * 4 // 5:]
    unigram: dict[str, int] = {}
    context: dict[tuple[str, str], dict[str, int]] = {}
    for words in train:
        for i in range(1, len(words) - 1):
            unigram[words[i]] = unigram.get(words[i], 0) + 1
            counts = context.setdefault((words[i - 1], words[i + 1]), {})
            counts[words[i]] = counts.get(words[i], 0) + 1
    top = max(unigram, key=unigram.__getitem__)
    hits = [(w[i] == top, w[i] == max(context.get((w[i - 1], w[i + 1]), {top: 1}).items(),
                                       key=lambda kv: kv[1])[0]) for w in test for i in range(1, len(w) - 1)]
    unigram_acc, context_acc = np.mean(hits, axis=0)
    assert context_acc > unigram_acc + 0.2


@pytest.mark.parametrize(("content", "fmt", "message"), [
    ('{"text": "ok"}\n{"body": "no text"}\n', "jsonl", r"c:2 has no string field 'text'"),
    ('{"text": "ok"}\nnot json\n', "jsonl", r"c:2 is not a JSON object"),
    ("", "text", "is empty"),
    ("\n \n\n", "text", "no text in a whole shard"),
    (b"\xff\xfe bad\n", "text", "not UTF-8"),
])
def test_bad_corpus_files_fail_with_one_line(tmp_path: Path, content: str | bytes, fmt: str, message: str) -> None:
    path = tmp_path / "c"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=message) as err:
        stream = BatchStream(stream_config(path, format=fmt, num_shards=1, batch_rows=2), TOK)
        next(stream)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_bad_settings_fail_with_one_line(numbered: Path, tmp_path: Path) -> None:
    cases = [
        (stream_config(tmp_path / "missing.txt"), {}, "matches no file"),
        (stream_config(tmp_path / "*.nothing"), {}, "matches no file"),
        (stream_config(numbered, batch_rows=6), {}, "does not divide among 4 corpus shards"),
        (stream_config(numbered), {"process_count": 3}, "do not divide among 3 processes"),
        (stream_config(numbered, block_bytes=1 << 20), {}, "2 blocks for 4 shards"),
        (stream_config(numbered, format="csv"), {}, "unknown corpus format"),
    ]
    for cfg, kw, message in cases:
        with pytest.raises(DataError, match=message):
            BatchStream(cfg, TOK, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_process_prefetch_resumes_exactly(numbered: Path) -> None:
    stream = BatchStream(stream_config(numbered), TOK, prefetch="process")
    take(stream, 9)
    state = stream.get_state()
    expected = take(stream, 10)
    stream.close()
    resumed = BatchStream(stream_config(numbered), TOK, prefetch="process")
    resumed.set_state(state)
    inline = take(BatchStream(stream_config(numbered), TOK), 19)[9:]  # the worker changes where, not what
    for a, b, c in zip(expected, take(resumed, 10), inline, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["tokens"], c["tokens"])
    resumed.close()  # an inline stream may take this state too: tests/train/data/test_elastic_resume.py
