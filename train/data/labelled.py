"""Datasets, the fixed split, and batches: deterministic, resumable, padded to length buckets.

Shape letters: N examples in a batch (rows), L padded length (a bucket), S segments per packed row.
Batch dict (the contract every step and diagnostic takes): tokens int32[N, L], valid_tokens bool[N, L]
(True = real token, real tokens first), labels int32[N] (label < 0 = a padding example that the loss
ignores); packed rows add segment_ids int32[N, L] and labels become int32[N, S].

The order of training examples is a pure function of (seed, step): epoch e visits the split in the permutation
drawn from (seed, e), and with a global batch of n = train.batch_size rows, step t takes global positions
[t*n, (t+1)*n) of that endless stream. A resumed run therefore sees exactly the batches it would have seen,
with no iterator state to checkpoint (train/data/batches.py wraps these functions as the loop's batch source),
and each of W processes takes its contiguous share of the same global batch.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from train.config import DataConfig
from train.data.datasets import (
    VADER_FILES,
    DataError,
    Examples,
    check_process,
    load_file,
    load_vader,
    synthetic_examples,
)
from train.data.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    IdTokenizer,
    Tokenizer,
    has_tokenizer,
    load_tokenizer,
    truncate,
)

__all__ = [
    "BpeTokenizer", "ByteTokenizer", "DataError", "Dataset", "IdTokenizer", "Split", "Tokenizer",
    "encode_texts", "eval_batches", "load_dataset", "load_tokenizer", "pack_examples", "train_batch",
    "unpack_examples",
]

Batch = dict[str, np.ndarray]


@dataclass(frozen=True)
class Split:
    tokens: list[np.ndarray]  # int32 ids per example, truncated to max_len
    labels: np.ndarray  # int32[E]
    texts: list[str]
    pad_id: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Dataset:
    train: Split
    validation: Split
    test: Split
    label_names: list[str]
    tokenizer: Tokenizer
    truncated: dict[str, int] = field(default_factory=dict)  # examples cut to max_len, per split

    def summary(self) -> str:
        """One line for the run log: sizes, classes, tokenizer, truncation."""
        sizes = ", ".join(f"{name} {len(getattr(self, name))}" for name in ("train", "validation", "test"))
        cut = ", ".join(f"{k} {v}" for k, v in self.truncated.items())
        kind = "id: the synthetic rows' integers" if self.tokenizer.kind == "id" else self.tokenizer.kind
        return (f"data: {sizes}; classes {self.label_names}; tokenizer {kind} "
                f"(vocab {self.tokenizer.vocab_size}); truncated to max_len: {cut}")


# --- loading ----------------------------------------------------------------------------------


def _examples(cfg: DataConfig) -> Examples:
    if cfg.source in VADER_FILES:
        return load_vader(cfg.source, Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None)
    if cfg.source == "file":
        assert cfg.path is not None  # DataConfig requires it for source=file
        return load_file(Path(cfg.path).expanduser(), cfg.format, cfg.text_column, cfg.label_column, cfg.labels)
    return synthetic_examples(cfg.synthetic_task, cfg.synthetic_size, cfg.synthetic_vocab, cfg.synthetic_len,
                              cfg.split_seed)


def split_indices(count: int, fractions: Sequence[float], seed: int) -> list[np.ndarray]:
    """A fixed, seeded permutation cut into train/validation/test index arrays."""
    perm = np.random.default_rng([seed, 1]).permutation(count)
    n_train = round(fractions[0] * count)
    n_val = round(fractions[1] * count)
    parts = [perm[:n_train], perm[n_train:n_train + n_val], perm[n_train + n_val:]]
    if min(len(p) for p in parts) == 0:
        raise DataError(f"{count} examples leave a split empty with data.split={tuple(fractions)}: "
                        "add examples or change data.split")
    return parts


def _tokenizer(cfg: DataConfig, train_texts: list[str], tokenizer_dir: Path | None) -> Tokenizer:
    # A pretrained checkpoint's tokenizer reads any source, the synthetic rows included.
    want = "id" if cfg.source == "synthetic" and cfg.tokenizer != "pretrained" else cfg.tokenizer
    if tokenizer_dir is not None and has_tokenizer(tokenizer_dir):
        tok = load_tokenizer(tokenizer_dir)
        if tok.kind != want:
            raise DataError(f"the run's tokenizer in {tokenizer_dir} is '{tok.kind}' but the config asks for "
                            f"'{want}': use the run's data settings or a new workdir")
        if isinstance(tok, IdTokenizer) and tok.symbols != cfg.synthetic_vocab:
            raise DataError(f"the run's tokenizer has {tok.symbols} symbols but data.synthetic_vocab="
                            f"{cfg.synthetic_vocab}: use the run's value or a new workdir")
        return tok
    if want == "pretrained":
        raise DataError("data.tokenizer=pretrained reads a checkpoint's tokenizer.json: set model.init_from=hf:<dir> "
                        "(or choose data.tokenizer=byte or bpe)")
    if want == "id":
        return IdTokenizer(cfg.synthetic_vocab)
    if want == "bpe":
        return BpeTokenizer.train(train_texts, cfg.bpe_vocab_size)
    return ByteTokenizer()


def _encode_split(tok: Tokenizer, texts: list[str], labels: np.ndarray, max_len: int) -> tuple[Split, int]:
    full = [tok.encode(t) for t in texts]
    truncated = sum(len(ids) > max_len for ids in full)
    tokens = [np.asarray(truncate(tok, ids, max_len), np.int32) for ids in full]
    return Split(tokens, np.asarray(labels, np.int32), texts, tok.pad_id), truncated


def load_dataset(cfg: DataConfig, tokenizer_dir: Path | None = None, tokenizer: Tokenizer | None = None,
                 examples: Examples | None = None) -> Dataset:
    """Load `cfg.source` (or take `examples`, a task's own reading of it), split it (seeded by
    cfg.split_seed), tokenize and truncate each split.

    `tokenizer` (a pretrained checkpoint's, see train/init_from/) is used as given; else if
    `tokenizer_dir` holds a saved tokenizer it is loaded (resume, evaluate); otherwise one is built
    (BPE is trained on the training split only). Nothing is written: the caller saves the tokenizer.
    """
    if cfg.max_len > cfg.buckets[-1]:
        raise DataError(f"data.max_len={cfg.max_len} exceeds the largest bucket {cfg.buckets[-1]}: add a bucket "
                        ">= max_len to data.buckets or lower data.max_len")
    ex = examples if examples is not None else _examples(cfg)
    parts = split_indices(len(ex.texts), cfg.split, cfg.split_seed)
    train_texts = [ex.texts[i] for i in parts[0]]
    tok = tokenizer if tokenizer is not None else _tokenizer(cfg, train_texts, tokenizer_dir)
    splits: dict[str, Split] = {}
    truncated: dict[str, int] = {}
    for name, idx in zip(("train", "validation", "test"), parts, strict=True):
        texts = train_texts if name == "train" else [ex.texts[i] for i in idx]
        splits[name], truncated[name] = _encode_split(tok, texts, ex.labels[idx], cfg.max_len)
    return Dataset(splits["train"], splits["validation"], splits["test"], ex.label_names, tok, truncated)


# --- batches ----------------------------------------------------------------------------------


def bucket_length(longest: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `longest` tokens."""
    i = bisect.bisect_left(list(buckets), longest)
    if i == len(buckets):
        raise DataError(f"a row of {longest} tokens exceeds the largest bucket {buckets[-1]}: add a bucket "
                        ">= data.max_len to data.buckets")
    return int(buckets[i])


def pad_rows(rows: Sequence[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((len(rows), length), pad_id, np.int32)  # [N, L]
    lengths = np.asarray([len(r) for r in rows], np.int64)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    valid = np.arange(length)[None, :] < lengths[:, None]  # [N, L], real tokens first
    return tokens, valid


def _share(batch: Batch, process_index: int, process_count: int) -> Batch:
    rows = len(batch["labels"])
    check_process(process_index, process_count)
    if rows % process_count:
        raise DataError(f"batch size {rows} does not divide among {process_count} processes: make "
                        "train.batch_size a multiple of the process count")
    per = rows // process_count
    return {k: v[process_index * per:(process_index + 1) * per] for k, v in batch.items()}


@functools.lru_cache(maxsize=16)
def _epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(count)
    order.flags.writeable = False
    return order


def train_indices(count: int, *, seed: int, step: int, batch_size: int) -> np.ndarray:
    """Example indices of the global batch at `step`: positions [step*n, (step+1)*n) of the epoch stream,
    n = batch_size."""
    if count == 0:
        raise DataError("the training split is empty: add examples or change data.split")
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = np.divmod(positions, count)
    return np.concatenate([_epoch_order(seed, int(e), count)[offsets[epochs == e]] for e in np.unique(epochs)])


def sorted_window_indices(split: Split, *, seed: int, step: int, batch_size: int, window: int) -> np.ndarray:
    """Example indices of the global batch at `step` when batches are length-sorted within windows.

    Window w holds the examples of steps [w*W, (w+1)*W) of the epoch stream (`train_indices`); they are
    sorted by length (ties in stream order) and cut into W batches of similar lengths, which the window's
    steps take in an order drawn from (seed, w). Every example is still seen once an epoch (up to the
    windows that straddle epochs) and a batch stays a pure function of (seed, step).
    """
    w, k = divmod(step, window)
    pool = train_indices(len(split), seed=seed, step=w, batch_size=batch_size * window)
    lengths = np.asarray([len(split.tokens[i]) for i in pool])
    ordered = pool[np.argsort(lengths, kind="stable")].reshape(window, batch_size)
    turn = np.random.default_rng([seed, w, 0x50F7]).permutation(window)
    return ordered[turn[k]]


def train_batch(
    split: Split, *, seed: int, step: int, batch_size: int, buckets: list[int],
    process_index: int = 0, process_count: int = 1, pack_segments: int | None = None, sort_window: int = 0,
) -> Batch:
    """This process's share of the global batch for `step`, a pure function of (seed, step).

    The whole global batch pads to the smallest bucket that fits its longest row, so every process gets
    the same L. Returns tokens int32[N, L], valid_tokens bool[N, L], labels int32[N], N = batch_size / P.
    With pack_segments=S the same examples are packed instead (`packed_batch`); with sort_window=W > 1
    the batch holds examples of similar length (`sorted_window_indices`).
    """
    if sort_window > 1:
        idx = sorted_window_indices(split, seed=seed, step=step, batch_size=batch_size, window=sort_window)
    else:
        idx = train_indices(len(split), seed=seed, step=step, batch_size=batch_size)
    rows = [split.tokens[i] for i in idx]
    if pack_segments is not None:
        batch = packed_batch(rows, split.labels[idx], row_len=buckets[-1], max_segments=pack_segments,
                             batch_size=batch_size, multiple=process_count, pad_id=split.pad_id)
        return _share(batch, process_index, process_count)
    length = bucket_length(max(len(r) for r in rows), buckets)
    tokens, valid = pad_rows(rows, length, split.pad_id)
    batch = {"tokens": tokens, "valid_tokens": valid, "labels": split.labels[idx].astype(np.int32)}
    return _share(batch, process_index, process_count)


def eval_batches(
    split: Split, *, batch_size: int, buckets: list[int], process_index: int = 0, process_count: int = 1,
    by_length: bool = False,
) -> Iterator[Batch]:
    """The whole split once, in order (`by_length`: shortest examples first, so each batch pads little);
    the last batch is filled with empty rows labelled -1."""
    order = np.argsort([len(t) for t in split.tokens], kind="stable") if by_length else np.arange(len(split))
    for start in range(0, len(split), batch_size):
        rows = [split.tokens[i] for i in order[start:start + batch_size]]
        labels = split.labels[order[start:start + batch_size]]
        missing = batch_size - len(rows)
        rows = rows + [np.zeros(0, np.int32)] * missing
        length = bucket_length(max(len(r) for r in rows), buckets)
        tokens, valid = pad_rows(rows, length, split.pad_id)
        labels = np.concatenate([labels, np.full(missing, -1, np.int32)]).astype(np.int32)
        yield _share({"tokens": tokens, "valid_tokens": valid, "labels": labels}, process_index, process_count)


def encode_texts(tokenizer: Tokenizer, texts: list[str], max_len: int, buckets: list[int]) -> Batch:
    """Tokenize free text for `predict`: one row per text, truncated to max_len, labels -1. A text that is
    empty, only whitespace or gives no tokens is a DataError."""
    if not texts:
        raise DataError("no text to classify: pass one or more texts")
    rows = [np.asarray(truncate(tokenizer, tokenizer.encode(t), max_len), np.int32) for t in texts]
    empty = [i for i, (t, r) in enumerate(zip(texts, rows, strict=True)) if len(r) == 0 or not t.strip()]
    if empty:
        raise DataError(f"text {empty[0] + 1} is empty or only whitespace: pass a text to classify")
    tokens, valid = pad_rows(rows, bucket_length(max(len(r) for r in rows), buckets), tokenizer.pad_id)
    return {"tokens": tokens, "valid_tokens": valid, "labels": np.full(len(texts), -1, np.int32)}


# --- sequence packing -------------------------------------------------------------------------


def pack_examples(
    tokens: Sequence[np.ndarray], labels: np.ndarray, *, row_len: int, max_segments: int, pad_id: int = 0,
) -> Batch:
    """Pack whole examples into rows of `row_len` tokens, at most `max_segments` (S) per row.

    Best-fit decreasing (longest example first, into the open row with the least room that fits it):
    deterministic, and close to the fewest rows. Returns
      tokens int32[N, row_len], valid_tokens bool[N, row_len] (real tokens first, padding at the end),
      segment_ids int32[N, row_len] (0..S-1 in row order; -1 on padding, which matches no segment),
      labels int32[N, S] (-1 for an empty slot), example_index int32[N, S] (the input index, -1 if empty).
    Feed segment_ids and num_segments=S to `Classifier` to get logits [N, S, C].
    """
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row) of rows that can take more, sorted
    for i in sorted(range(len(tokens)), key=lambda i: (-len(tokens[i]), i)):
        n = len(tokens[i])
        if n > row_len:
            raise DataError(f"an example of {n} tokens does not fit a packed row of {row_len}: raise the row "
                            "length to >= data.max_len")
        j = bisect.bisect_left(room, (n, -1))
        if j < len(room):
            free, r = room.pop(j)
        else:
            free, r = row_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if len(rows[r]) < max_segments and free - n > 0:
            bisect.insort(room, (free - n, r))
    out_tokens = np.full((len(rows), row_len), pad_id, np.int32)  # [N, L]
    segment_ids = np.full((len(rows), row_len), -1, np.int32)  # [N, L]
    out_labels = np.full((len(rows), max_segments), -1, np.int32)  # [N, S]
    example_index = np.full((len(rows), max_segments), -1, np.int32)  # [N, S]
    for r, members in enumerate(rows):
        pos = 0
        for s, i in enumerate(sorted(members)):
            n = len(tokens[i])
            out_tokens[r, pos:pos + n] = tokens[i]
            segment_ids[r, pos:pos + n] = s
            out_labels[r, s] = labels[i]
            example_index[r, s] = i
            pos += n
    return {"tokens": out_tokens, "valid_tokens": segment_ids >= 0, "segment_ids": segment_ids,
            "labels": out_labels, "example_index": example_index}


def packed_batch(
    rows: Sequence[np.ndarray], labels: np.ndarray, *, row_len: int, max_segments: int, batch_size: int,
    multiple: int = 1, pad_id: int = 0,
) -> Batch:
    """A training batch of packed rows with a row count from a few fixed sizes (so a run compiles a few
    programs, as with length buckets): the smallest of batch_size/8, /4, /2, /1 (whole, a multiple of
    `multiple`) that holds the packing, topped up with empty rows (labels -1, no valid tokens).
    Returns tokens, valid_tokens, segment_ids [N, row_len] and labels int32[N, S]."""
    packed = pack_examples(rows, labels, row_len=row_len, max_segments=max_segments, pad_id=pad_id)
    packed.pop("example_index")
    need = len(packed["labels"])
    sizes = [batch_size // d for d in (8, 4, 2, 1) if batch_size % d == 0 and (batch_size // d) % multiple == 0]
    target = next((r for r in sizes if r >= need), batch_size)  # need <= batch_size: one example per row at most
    return top_up(packed, target, pad_id)


def top_up(packed: Batch, rows: int, pad_id: int = 0) -> Batch:
    """Packed rows extended to `rows` with empty ones (no valid tokens, segment -1, labels -1): they
    count nowhere."""
    fill = {"tokens": pad_id, "valid_tokens": False, "segment_ids": -1, "labels": -1}
    missing = rows - len(packed["tokens"])
    return {k: np.concatenate([v, np.full((missing, *v.shape[1:]), fill[k], v.dtype)]) for k, v in packed.items()}


def unpack_examples(packed: Batch) -> dict[int, tuple[np.ndarray, int]]:
    """Inverse of `pack_examples`: example index -> (its tokens, its label)."""
    out: dict[int, tuple[np.ndarray, int]] = {}
    for r, s in zip(*np.nonzero(packed["example_index"] >= 0), strict=True):
        seg = packed["segment_ids"][r] == s
        out[int(packed["example_index"][r, s])] = (packed["tokens"][r][seg], int(packed["labels"][r, s]))
    return out
