"""Elastic resume: a streamed run saved by P processes continues on P' (2 -> 1, 1 -> 2, 4 -> 2), each
example of the stream read exactly once across the change, with the same global batches (and masking)
as the uninterrupted stream; in-process streams here, real processes in tests/train/devices/test_multihost.py."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from tests.conftest import lines_in, stream_config, stream_tokenizer
from train.data.datasets import DataError
from train.data.masking import MaskingSpec
from train.data.stream import BatchStream, merge_states

TOK = stream_tokenizer()
SPEC = MaskingSpec.for_tokenizer(TOK)
BEFORE, AFTER = 5, 7


def global_batches(streams: list[BatchStream], n: int) -> list[dict[str, np.ndarray]]:
    """n global batches: every process's rows, in process order."""
    out = []
    for _ in range(n):
        parts = [next(s) for s in streams]
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out


def streams(root, count: int, **kw) -> list[BatchStream]:
    return [BatchStream(stream_config(root), TOK, process_index=p, process_count=count, masking=SPEC, **kw)
            for p in range(count)]


def saved_states(group: list[BatchStream]) -> list[dict]:
    return [json.loads(json.dumps(s.get_state())) for s in group]  # as they travel through a JSON checkpoint


def assert_same(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), pytest.param(4, 2, marks=pytest.mark.slow),
                                               pytest.param(2, 4, marks=pytest.mark.slow)])
def test_a_stream_saved_by_p_processes_continues_on_p_prime_exactly_once(numbered, before, after):
    whole = global_batches(streams(numbered, 1), BEFORE + AFTER)
    first = streams(numbered, before)
    head = global_batches(first, BEFORE)
    states = saved_states(first)
    second = streams(numbered, after)
    for s in second:
        s.set_state(merge_states(states))
        assert s.step == BEFORE
    tail = global_batches(second, AFTER)
    assert_same(head + tail, whole)
    # Counted: every example read across the change, as often as the uninterrupted stream reads it
    # (none skipped, none read twice more), by line number (the masked positions' original ids).
    read, want = Counter(n for b in head + tail for n in lines(b)), Counter(n for b in whole for n in lines(b))
    assert read == want and sum(read.values()) == sum(want.values()) > 100


def lines(batch: dict[str, np.ndarray]) -> list[int]:
    original = np.where(batch["mlm_weights"] > 0, batch["mlm_targets"], batch["tokens"])
    return lines_in({"tokens": original, "valid_tokens": batch["valid_tokens"]})


@pytest.mark.slow
def test_the_prefetch_mode_may_change_on_resume(numbered):
    whole = global_batches(streams(numbered, 1), BEFORE + AFTER)
    first = streams(numbered, 2)
    head = global_batches(first, BEFORE)
    second = streams(numbered, 1, prefetch="thread")
    second[0].set_state(merge_states(saved_states(first)))
    try:
        assert_same(head + global_batches(second, AFTER), whole)
    finally:
        second[0].close()


def test_a_state_saved_before_positions_were_per_shard_still_resumes_elsewhere(numbered):
    whole = global_batches(streams(numbered, 1), BEFORE + AFTER)
    first = streams(numbered, 2)
    head = global_batches(first, BEFORE)
    old = []
    for s in first:  # the earlier layout: Grain's whole-iterator state, the process layout in the identity
        old.append({"identity": {**s.identity(), "process_index": s.process_index, "process_count": 2,
                                 "prefetch": None}, "step": s.step, "grain": s._iterator.get_state()})
    (single,) = streams(numbered, 1)
    single.set_state(merge_states(old))
    assert_same(head + global_batches([single], AFTER), whole)


def test_missing_or_disagreeing_positions_are_refused_in_one_line(numbered):
    first = streams(numbered, 2)
    global_batches(first, 2)
    states = saved_states(first)
    (single,) = streams(numbered, 1)
    with pytest.raises(DataError, match=r"no position for corpus shards \[0, 1\]"):
        single.set_state(merge_states(states[1:]))  # only process 1's shards
    next(first[0])
    with pytest.raises(DataError, match="disagree"):
        merge_states([states[0], first[0].get_state()])
    other = BatchStream(stream_config(numbered, seed=5), TOK)
    with pytest.raises(DataError, match="different corpus, batch size"):
        other.set_state(merge_states(states))
