"""Masked-language-modelling corruption: a pure function of (seed, step, global row, position).

Shape letters: N rows in a batch, L row length, V vocabulary size.

For each example (a packed row's segment, or the whole row when a batch has no `segment_ids`) a
fraction `rate` of its regular tokens is chosen: floor(rate * n + u), u uniform (so rate * n on
average, also for short examples), where n counts real tokens (valid_tokens True) whose id is regular
(>= first_regular_id, not the mask id).
Padding and special ids are never chosen. Each chosen token becomes the mask id (80%), a random
regular id (10%) or itself (10%). With whole-word masking, words are chosen instead of tokens (in
random order while a word's midpoint stays within the example's budget) and every token of a chosen
word is corrupted.

A row holds at most `max_per_row` chosen tokens (the model's prediction slots, P): where a packed row's
examples would choose more, the row keeps its chosen words in score order while they fit, so no chosen
token goes unpredicted and a word is never split.

Randomness comes from a counter-based hash of (seed, step, global row index, position), computed on the
host in NumPy. A row's corruption therefore depends only on its global row index, never on how the
global batch is split among processes or devices: 1 process x 8 devices and 2 processes x 4 mask the
same rows identically, and a resumed run masks exactly as the uninterrupted one. Doing it on the host
also keeps the compiled step free of data-dependent random ops, and the work runs inside the input
pipeline (overlapping the step) rather than on the accelerator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from train.data.tokenizer import BpeTokenizer, IdTokenizer, Tokenizer

__all__ = ["MaskingSpec", "mask_batch", "prediction_slots", "word_start_table"]

Batch = dict[str, np.ndarray]

_GOLDEN = 0x9E3779B97F4A7C15
_CHOOSE, _ACTION, _RANDOM_ID, _ROUND = 1, 2, 3, 4  # independent hash streams


@dataclass(frozen=True)
class MaskingSpec:
    """What the corruption may choose and write.

    mask_id: the id written at 80% of chosen positions (outside [first_regular_id, random_high)).
    first_regular_id: ids below it are specials (pad, unk, ...): never chosen, never drawn.
    random_high: random replacements are drawn uniformly from [first_regular_id, random_high).
    rate: fraction of regular tokens chosen per example; mask_fraction / random_fraction: the 80/10 split
      (the rest keep their id).
    word_starts: bool[V], True for ids that begin a word (whole-word masking); None = token masking.
    max_per_row: at most this many chosen tokens a row (the model's P prediction slots); None: no cap.
    """

    mask_id: int
    first_regular_id: int
    random_high: int
    rate: float = 0.15
    mask_fraction: float = 0.8
    random_fraction: float = 0.1
    word_starts: np.ndarray | None = None
    max_per_row: int | None = None

    def __post_init__(self) -> None:
        if self.max_per_row is not None and self.max_per_row < 1:
            raise ValueError(f"max_per_row={self.max_per_row} must be at least 1")
        if not 0.0 < self.rate < 1.0:
            raise ValueError(f"masking rate {self.rate} must lie in (0, 1)")
        if self.mask_fraction < 0 or self.random_fraction < 0 or self.mask_fraction + self.random_fraction > 1:
            raise ValueError("mask_fraction and random_fraction must be >= 0 and sum to <= 1")
        if not 0 <= self.first_regular_id < self.random_high:
            raise ValueError(f"no regular ids in [{self.first_regular_id}, {self.random_high})")
        if self.first_regular_id <= self.mask_id < self.random_high:
            raise ValueError(f"mask id {self.mask_id} lies among the regular ids: reserve it as a special id")

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, *, rate: float = 0.15, whole_word: bool = False,
                      max_per_row: int | None = None) -> MaskingSpec:
        """The spec for one of train/data/tokenizer.py's tokenizers.

        A tokenizer with a `mask_id` attribute uses it; otherwise the mask id is appended after the
        vocabulary (mask_id = tokenizer.vocab_size), so the model's embedding needs `model_vocab_size`
        rows. Specials are the ids below 2 (BPE, id: pad, unk) or 3 (byte: pad, bos, eos).
        """
        first = {"bpe": 2, "id": 2, "byte": 3}.get(tokenizer.kind, 1)
        mask_id = int(getattr(tokenizer, "mask_id", tokenizer.vocab_size))
        if first <= mask_id < tokenizer.vocab_size:  # a mask token inside the vocabulary is one more special
            first = max(first, mask_id + 1)
        starts = word_start_table(tokenizer) if whole_word else None
        return cls(mask_id, first, tokenizer.vocab_size, rate=rate, word_starts=starts, max_per_row=max_per_row)

    @property
    def model_vocab_size(self) -> int:
        """Rows the embedding needs to take every input this corruption can write."""
        return max(self.random_high, self.mask_id + 1)


def prediction_slots(rate: float, length: int, configured: int | None = None) -> int:
    """P, the masked-LM head's prediction slots for rows of `length` tokens: `configured`
    (mlm.predictions_per_row), else ceil(1.6 * rate * length) + 2, room for the spread of the per-example
    rounding and whole words around rate * length; never more than the row."""
    p = configured or math.ceil(1.6 * rate * length) + 2
    return max(1, min(p, length))


def word_start_table(tokenizer: Tokenizer) -> np.ndarray | None:
    """bool[V]: ids that begin a word, or None when the tokenizer does not mark word starts (bytes).

    Byte-level BPE marks a leading space with 'Ġ' (every word starts with one: add_prefix_space=True);
    the id tokenizer's tokens are whole words.
    """
    if isinstance(tokenizer, IdTokenizer):
        return np.ones(tokenizer.vocab_size, bool)
    if isinstance(tokenizer, BpeTokenizer):
        vocab = tokenizer._tok.get_vocab()  # token string -> id; the wrapper exposes no token strings
        table = np.zeros(tokenizer.vocab_size, bool)
        for token, i in vocab.items():
            table[i] = token.startswith("Ġ")
        return table
    return None


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 whose output bits look independent."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(seed: int, step: int, rows: np.ndarray, length: int, stream: int) -> np.ndarray:
    """float64[N, L] in [0, 1): a hash of (seed, step, global row, position, stream)."""
    with np.errstate(over="ignore"):
        key = _mix(np.full((1, 1), (seed * _GOLDEN + stream) % 2**64, np.uint64))
        key = _mix(key ^ np.uint64(step % 2**64))
        h = _mix(key ^ _mix(rows.astype(np.uint64)[:, None] + np.uint64(_GOLDEN)))
        h = _mix(h ^ np.arange(length, dtype=np.uint64)[None, :])
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _choose(score: np.ndarray, eligible: np.ndarray, group: np.ndarray, rate: float, jitter: np.ndarray,
            word_start: np.ndarray | None, max_per_row: int | None) -> np.ndarray:
    """bool[N, L]: per group of n eligible positions, the floor(rate*n + u) of lowest score (u uniform, so
    the expected count is exactly rate*n); with word starts, whole words in score order until then. Then
    at most `max_per_row` a row (`_cap_rows`)."""
    flat = np.flatnonzero(eligible.ravel())
    if flat.size == 0:
        return np.zeros(eligible.shape, bool)
    s = score.ravel()
    if word_start is not None:  # every token of a word takes the score of the word's first token
        begins = np.where(word_start.ravel(), np.arange(s.size), 0)
        s = s[np.maximum.accumulate(begins)]
    _, first_seen, inv, counts = np.unique(group.ravel()[flat], return_index=True, return_inverse=True,
                                           return_counts=True)
    budget = np.floor(rate * counts + jitter.ravel()[flat[first_seen]])
    order = np.lexsort((flat, s[flat], inv))  # by group, then score, then position
    sorted_group = inv[order]
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    taken = (np.arange(order.size) - first[sorted_group]).astype(np.float64)  # tokens of the group before
    if word_start is not None:  # a word is taken whole when its midpoint falls within the budget
        is_begin = word_start.ravel()[flat[order]]
        is_begin[first] = True
        word = np.cumsum(is_begin) - 1
        length = np.bincount(word)
        taken = taken[np.flatnonzero(is_begin)][word] + (length[word] - 1) / 2
    flat_chosen = np.zeros(eligible.size, bool)
    flat_chosen[flat[order[taken < budget[sorted_group]]]] = True
    chosen = flat_chosen.reshape(eligible.shape)
    return chosen if max_per_row is None else _cap_rows(chosen, s.reshape(eligible.shape), max_per_row)


def _cap_rows(chosen: np.ndarray, score: np.ndarray, cap: int) -> np.ndarray:
    """bool[N, L]: of each row's chosen tokens, the words of lowest score while the row's count stays within
    `cap`. A word's tokens share its score and sit side by side, so in (score, position) order they are
    consecutive: a word is kept when its last token's place in that order is within the cap."""
    rows, cols = np.nonzero(chosen)
    per_row = np.bincount(rows, minlength=chosen.shape[0])
    if per_row.max(initial=0) <= cap:
        return chosen
    order = np.lexsort((cols, score[rows, cols], rows))  # by row, then score, then position
    rows, cols = rows[order], cols[order]
    s = score[rows, cols]
    first_of_row = np.concatenate([[0], np.cumsum(per_row)[:-1]])
    place = np.arange(rows.size) - first_of_row[rows]  # 0-based place in the row's order
    new_word = np.ones(rows.size, bool)
    new_word[1:] = (rows[1:] != rows[:-1]) | (s[1:] != s[:-1])
    word = np.cumsum(new_word) - 1
    last_place = place[np.append(np.flatnonzero(new_word)[1:], rows.size) - 1]  # the token before the next word
    keep = last_place[word] < cap
    capped = np.zeros_like(chosen)
    capped[rows[keep], cols[keep]] = True
    return capped


def mask_batch(batch: Batch, spec: MaskingSpec, *, seed: int, step: int, row_offset: int = 0) -> Batch:
    """The MLM view of `batch` at training step `step`.

    batch: tokens int32[N, L], valid_tokens bool[N, L] (+ optional segment_ids int32[N, L], -1 on padding).
    Local row i is global row `row_offset + i` (this process's first row in the global batch).
    Returns a new dict with every input key, `tokens` corrupted, plus
      mlm_targets int32[N, L]: the original ids (the loss reads them where mlm_weights is 1),
      mlm_weights float32[N, L]: 1.0 at chosen positions, else 0.
    """
    tokens = np.asarray(batch["tokens"], np.int32)
    valid = np.asarray(batch["valid_tokens"], bool)
    n, length = tokens.shape
    segments = np.asarray(batch["segment_ids"]) if "segment_ids" in batch else np.where(valid, 0, -1)
    rows = np.arange(row_offset, row_offset + n, dtype=np.int64)
    eligible = valid & (tokens >= spec.first_regular_id) & (tokens != spec.mask_id) & (tokens < spec.random_high)
    group = np.arange(n, dtype=np.int64)[:, None] * (length + 1) + segments  # one group per (row, segment)
    word_start = None
    if spec.word_starts is not None:
        previous_same = np.zeros_like(eligible)
        previous_same[:, 1:] = eligible[:, :-1] & (segments[:, 1:] == segments[:, :-1])
        in_table = spec.word_starts[np.clip(tokens, 0, len(spec.word_starts) - 1)]
        word_start = ~previous_same | in_table  # a word also starts after a special or a segment boundary
    chosen = _choose(_uniform(seed, step, rows, length, _CHOOSE), eligible, group, spec.rate,
                     _uniform(seed, step, rows, length, _ROUND), word_start, spec.max_per_row)
    action = _uniform(seed, step, rows, length, _ACTION)
    to_mask = chosen & (action < spec.mask_fraction)
    to_random = chosen & (action >= spec.mask_fraction) & (action < spec.mask_fraction + spec.random_fraction)
    span = spec.random_high - spec.first_regular_id
    random_ids = spec.first_regular_id + np.floor(_uniform(seed, step, rows, length, _RANDOM_ID) * span)
    inputs = np.where(to_mask, spec.mask_id, np.where(to_random, random_ids.astype(np.int32), tokens))
    out = dict(batch)
    out.update(tokens=inputs.astype(np.int32), mlm_targets=tokens.copy(), mlm_weights=chosen.astype(np.float32))
    return out
