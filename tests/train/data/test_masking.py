"""MLM corruption: statistics, what may never be chosen, determinism and layout independence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data.masking import MaskingSpec, mask_batch, word_start_table
from train.data.tokenizer import BpeTokenizer, ByteTokenizer, IdTokenizer

V = 1000
SPEC = MaskingSpec(mask_id=V, first_regular_id=2, random_high=V)


def packed_batch(seed: int = 0, rows: int = 256, length: int = 128) -> dict[str, np.ndarray]:
    """Rows of random examples (3..40 tokens) packed end to end, padding after; some unk (1) inside."""
    rng = np.random.default_rng(seed)
    segments = np.full((rows, length), -1, np.int32)
    for r in range(rows):
        pos, s = 0, 0
        while pos < length - 50 or (s == 0):
            n = int(rng.integers(3, 41))
            segments[r, pos:pos + n] = s
            pos, s = pos + n, s + 1
    valid = segments >= 0
    tokens = np.where(valid, rng.integers(2, V, (rows, length)), 0).astype(np.int32)
    tokens[valid & (rng.random((rows, length)) < 0.05)] = 1  # specials among real tokens
    return {"tokens": tokens, "valid_tokens": valid, "segment_ids": segments}


def test_fraction_and_80_10_10_split() -> None:
    batch = packed_batch()
    out = mask_batch(batch, SPEC, seed=0, step=0)
    chosen = out["mlm_weights"] > 0
    regular = batch["valid_tokens"] & (batch["tokens"] >= 2)
    assert abs(chosen.sum() / regular.sum() - 0.15) < 0.005
    tokens, original = out["tokens"][chosen], batch["tokens"][chosen]
    assert abs((tokens == V).mean() - 0.8) < 0.02
    assert abs(((tokens != V) & (tokens != original)).mean() - 0.1) < 0.015
    assert abs((tokens == original).mean() - 0.1) < 0.015


def test_each_example_gets_its_share() -> None:
    batch = packed_batch(rows=64)
    chosen = mask_batch(batch, SPEC, seed=3, step=7)["mlm_weights"] > 0
    regular = batch["valid_tokens"] & (batch["tokens"] >= 2)
    for r in range(64):
        for s in range(batch["segment_ids"][r].max() + 1):
            seg = batch["segment_ids"][r] == s
            n = regular[r, seg].sum()
            assert chosen[r, seg].sum() in (np.floor(0.15 * n), np.ceil(0.15 * n))


def test_never_padding_or_specials_and_the_rest_untouched() -> None:
    batch = packed_batch(seed=1)
    out = mask_batch(batch, SPEC, seed=1, step=2)
    chosen = out["mlm_weights"] > 0
    assert not chosen[~batch["valid_tokens"]].any()
    assert not chosen[batch["tokens"] < 2].any()
    np.testing.assert_array_equal(out["tokens"][~chosen], batch["tokens"][~chosen])
    np.testing.assert_array_equal(out["mlm_targets"], batch["tokens"])
    assert out["tokens"][chosen].min() >= 2 and out["tokens"].max() <= V  # random ids are regular ids
    assert out["mlm_targets"].dtype == np.int32 and out["mlm_weights"].dtype == np.float32
    np.testing.assert_array_equal(out["segment_ids"], batch["segment_ids"])


def test_pure_in_seed_step_row_and_split_invariant() -> None:
    batch = packed_batch(seed=2, rows=32)
    a = mask_batch(batch, SPEC, seed=5, step=11)
    b = mask_batch(batch, SPEC, seed=5, step=11)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    # two processes holding global rows [0, 16) and [16, 32) corrupt exactly as one process with all 32
    halves = [mask_batch({k: v[i * 16:(i + 1) * 16] for k, v in batch.items()}, SPEC, seed=5, step=11,
                         row_offset=i * 16) for i in range(2)]
    for key in a:
        np.testing.assert_array_equal(a[key], np.concatenate([h[key] for h in halves]))
    other_step = mask_batch(batch, SPEC, seed=5, step=12)["mlm_weights"]
    other_seed = mask_batch(batch, SPEC, seed=6, step=11)["mlm_weights"]
    assert (other_step != a["mlm_weights"]).mean() > 0.1 and (other_seed != a["mlm_weights"]).mean() > 0.1


def test_batch_without_segments_is_one_example_per_row() -> None:
    batch = packed_batch(rows=16)
    plain = {"tokens": batch["tokens"], "valid_tokens": batch["valid_tokens"]}
    chosen = mask_batch(plain, SPEC, seed=0, step=0)["mlm_weights"] > 0
    regular = (batch["valid_tokens"] & (batch["tokens"] >= 2)).sum(axis=1)
    counts = chosen.sum(axis=1)
    assert np.all((counts == np.floor(0.15 * regular)) | (counts == np.ceil(0.15 * regular)))


def test_whole_word_masking_takes_whole_words() -> None:
    batch = packed_batch(seed=4)
    starts = np.random.default_rng(0).random(V + 1) < 0.4  # words of 2.5 tokens on average
    spec = MaskingSpec(mask_id=V, first_regular_id=2, random_high=V, word_starts=starts)
    chosen = mask_batch(batch, spec, seed=0, step=0)["mlm_weights"] > 0
    regular = batch["valid_tokens"] & (batch["tokens"] >= 2)
    assert abs(chosen.sum() / regular.sum() - 0.15) < 0.02
    seg = batch["segment_ids"]
    for r in range(len(seg)):  # a continuation token is chosen exactly when the token before it is
        for j in range(1, seg.shape[1]):
            continues = regular[r, j] and regular[r, j - 1] and seg[r, j] == seg[r, j - 1]
            if continues and not starts[batch["tokens"][r, j]]:
                assert chosen[r, j] == chosen[r, j - 1]


def test_specs_for_the_repo_tokenizers() -> None:
    byte = MaskingSpec.for_tokenizer(ByteTokenizer())
    assert (byte.first_regular_id, byte.mask_id, byte.model_vocab_size) == (3, 259, 260)
    assert byte.word_starts is None and word_start_table(ByteTokenizer()) is None
    ids = MaskingSpec.for_tokenizer(IdTokenizer(10), whole_word=True)
    assert ids.mask_id == 12 and ids.word_starts is not None and ids.word_starts.all()
    bpe = BpeTokenizer.train(["the cats sleep", "a dog sleeps soundly", "the dogs bark"] * 20, 300)
    spec = MaskingSpec.for_tokenizer(bpe, whole_word=True)
    assert spec.word_starts is not None and spec.mask_id == bpe.vocab_size
    first_ids = [bpe.encode(w)[0] for w in ("the", "sleeps", "soundly")]
    assert spec.word_starts[first_ids].all()
    with pytest.raises(ValueError, match="regular ids"):
        MaskingSpec(mask_id=5, first_regular_id=2, random_high=100)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31), st.integers(0, 10**6))
def test_invariants_on_any_batch(rows: int, length: int, seed: int, step: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, length + 1, rows)
    valid = np.arange(length)[None] < lengths[:, None]
    tokens = np.where(valid, rng.integers(0, 50, (rows, length)), 0).astype(np.int32)
    spec = MaskingSpec(mask_id=50, first_regular_id=2, random_high=50, rate=float(rng.uniform(0.05, 0.5)))
    out = mask_batch({"tokens": tokens, "valid_tokens": valid}, spec, seed=seed, step=step)
    chosen = out["mlm_weights"] > 0
    assert not chosen[~valid | (tokens < 2)].any()
    np.testing.assert_array_equal(out["tokens"][~chosen], tokens[~chosen])
    regular = (valid & (tokens >= 2)).sum(axis=1)
    assert np.all(np.abs(chosen.sum(axis=1) - spec.rate * regular) < 1)


def test_a_row_never_holds_more_chosen_tokens_than_its_prediction_slots() -> None:
    """max_per_row caps each row; a capped row keeps whole words, the lowest-scored ones, and rows within the
    cap are masked exactly as without it."""
    batch = packed_batch(seed=5, rows=128)
    starts = np.random.default_rng(1).random(V + 1) < 0.4
    free_spec = MaskingSpec(mask_id=V, first_regular_id=2, random_high=V, word_starts=starts)
    free = mask_batch(batch, free_spec, seed=2, step=3)["mlm_weights"] > 0
    counts = free.sum(axis=1)
    cap = int(np.percentile(counts, 30))  # most rows over it, some not
    assert (counts > cap).any() and (counts <= cap).any()
    capped_spec = MaskingSpec(mask_id=V, first_regular_id=2, random_high=V, word_starts=starts, max_per_row=cap)
    out = mask_batch(batch, capped_spec, seed=2, step=3)
    capped = out["mlm_weights"] > 0
    assert capped.sum(axis=1).max() <= cap
    assert not (capped & ~free).any()  # the cap only drops
    within = counts <= cap
    np.testing.assert_array_equal(capped[within], free[within])
    longest_word = max(len(w) for w in "".join("s" if x else "c" for x in starts[batch["tokens"]].ravel())
                       .split("s"))  # continuations in a row: a word is at most one more
    assert (capped.sum(axis=1)[~within] > cap - longest_word - 1).all()  # filled but for the word that overflows
    np.testing.assert_array_equal(out["tokens"][~capped], batch["tokens"][~capped])  # dropped: not corrupted
    regular = batch["valid_tokens"] & (batch["tokens"] >= 2)
    seg = batch["segment_ids"]
    for r in np.flatnonzero(~within):  # still whole words: a continuation goes with the token before it
        for j in range(1, seg.shape[1]):
            if regular[r, j] and regular[r, j - 1] and seg[r, j] == seg[r, j - 1] and not starts[batch["tokens"][r, j]]:
                assert capped[r, j] == capped[r, j - 1]


def test_token_masking_under_a_cap_keeps_the_lowest_scores() -> None:
    """Without word starts every token is a word of its own: a capped row holds exactly the cap, and those
    are the chosen tokens a larger cap would also keep (the order does not depend on the cap)."""
    batch = packed_batch(seed=6, rows=32)
    small = mask_batch(batch, MaskingSpec(mask_id=V, first_regular_id=2, random_high=V, max_per_row=5),
                       seed=0, step=0)["mlm_weights"] > 0
    large = mask_batch(batch, MaskingSpec(mask_id=V, first_regular_id=2, random_high=V, max_per_row=9),
                       seed=0, step=0)["mlm_weights"] > 0
    assert (small.sum(axis=1) == 5).all() and (large.sum(axis=1) <= 9).all()
    assert not (small & ~large).any()
    with pytest.raises(ValueError, match="max_per_row=0"):
        MaskingSpec(mask_id=V, first_regular_id=2, random_high=V, max_per_row=0)


def test_the_corpus_spec_caps_rows_at_the_task_prediction_slots() -> None:
    """load_corpus's masking and the task's select_positions use one P (prediction_slots): a run's rows never
    choose more tokens than the head predicts."""
    from tests.conftest import ROOT
    from train.config import load_config
    from train.data.batches import StreamBatches
    from train.data.masking import prediction_slots
    from train.data.pretrain import load_corpus
    from train.tasks.mlm import MaskedLMTask

    assert prediction_slots(0.15, 512) == 125 and prediction_slots(0.15, 512, 80) == 80
    assert prediction_slots(0.15, 4, 80) == 4 and prediction_slots(0.5, 1) == 1
    config = load_config(ROOT / "configs" / "pretrain_tiny.yaml", [
        "mlm.predictions_per_row=3", "data.corpus_bytes=200000", "data.bpe_sample_bytes=100000", "data.prefetch=none"])
    corpus = load_corpus(config, tokenizer_dir=None)
    assert corpus.masking.max_per_row == MaskedLMTask.from_config(config).predictions(config.data.max_len) == 3
    source = StreamBatches(corpus, config)
    try:
        assert (source.batch(0)["mlm_weights"].sum(axis=1) == 3).mean() > 0.5  # capped, not emptied
    finally:
        source.close()
