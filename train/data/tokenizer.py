"""Tokenizers: UTF-8 bytes, BPE (the `tokenizers` library), and identity ids for the synthetic tasks.

Our own tokenizers reserve id 0 for padding and encode without adding special tokens (the classifier pools
with a masked mean, so it needs no [CLS]). A pretrained checkpoint's tokenizer (`PretrainedTokenizer`, kind
"pretrained", from its `tokenizer.json`) keeps that checkpoint's ids, padding id and special tokens
(BERT's [CLS] ... [SEP], Llama's BOS: whatever its post-processor adds). Every tokenizer saves itself into a
directory beside the run: `tokenizer_config.json` names the kind, plus `tokenizer.json` for BPE and
pretrained ones. `load_tokenizer` reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from train.data.datasets import DataError

CONFIG_FILE = "tokenizer_config.json"
BPE_FILE = "tokenizer.json"
PAD, UNK = "<pad>", "<unk>"


@runtime_checkable
class Tokenizer(Protocol):
    kind: str  # "byte" | "bpe" | "id" | "pretrained"
    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, directory: Path) -> None: ...


def _write_config(directory: Path, config: dict[str, object]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


class ByteTokenizer:
    """UTF-8 bytes shifted past the specials: pad=0, bos=1, eos=2 (reserved), byte b -> b + 3."""

    kind = "byte"
    pad_id = 0
    offset = 3
    vocab_size = 256 + offset

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        _write_config(directory, {"kind": self.kind, "vocab_size": self.vocab_size})


class BpeTokenizer:
    """Byte-level BPE (no unknown characters: every byte is in the base alphabet), pad=0, unk=1."""

    kind = "bpe"

    def __init__(self, tokenizer: HFTokenizer):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        pad = tokenizer.token_to_id(PAD)
        if pad is None:
            raise DataError(f"BPE tokenizer has no {PAD} token: delete the tokenizer files to rebuild it")
        self.pad_id = pad

    @classmethod
    def train(cls, texts: list[str], vocab_size: int) -> BpeTokenizer:
        """Learn merges from `texts` (the training split only, so no evaluation text leaks in)."""
        tok = HFTokenizer(models.BPE())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD, UNK],  # ids 0 and 1, in this order
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids))).strip()

    def save(self, directory: Path) -> None:
        _write_config(directory, {"kind": self.kind, "vocab_size": self.vocab_size})
        self._tok.save(str(directory / BPE_FILE))


class PretrainedTokenizer:
    """A pretrained checkpoint's `tokenizers.Tokenizer` (its tokenizer.json), ids unchanged.

    `encode` adds the special tokens its post-processor defines ([CLS]/[SEP] for BERT-family, <s> for
    Llama-family), as transformers does; any padding or truncation saved in the file is switched off
    (batches pad with `pad_id` and truncate to data.max_len themselves).
    """

    kind = "pretrained"

    def __init__(self, tokenizer: HFTokenizer, pad_id: int):
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.pad_id = pad_id
        # The special tokens the post-processor puts after the text ([SEP] for BERT, </s> for RoBERTa, none
        # for Llama), found from one probe: a truncated row keeps them, as transformers' truncation does.
        bare = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a", add_special_tokens=True).ids
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare]
        self.closing: list[int] = list(full[starts[0] + len(bare):]) if bare and starts else []

    @classmethod
    def from_file(cls, path: Path, pad_id: int) -> PretrainedTokenizer:
        return cls(HFTokenizer.from_file(str(path)), pad_id)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True)).strip()

    def save(self, directory: Path) -> None:
        _write_config(directory, {"kind": self.kind, "vocab_size": self.vocab_size, "pad_id": self.pad_id})
        self._tok.save(str(directory / BPE_FILE))


class IdTokenizer:
    """Synthetic rows: whitespace-separated integers 0..symbols-1 -> id + 2 (pad=0, unk=1 for anything else)."""

    kind = "id"
    pad_id = 0
    unk_id = 1
    offset = 2

    def __init__(self, symbols: int):
        self.symbols = symbols
        self.vocab_size = symbols + self.offset

    def encode(self, text: str) -> list[int]:
        return [int(w) + self.offset if w.isdigit() and int(w) < self.symbols else self.unk_id for w in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(i - self.offset) if i >= self.offset else "?" for i in ids if i != self.pad_id)

    def save(self, directory: Path) -> None:
        _write_config(directory, {"kind": self.kind, "vocab_size": self.vocab_size, "symbols": self.symbols})


def truncate(tokenizer: Tokenizer, ids: list[int], max_len: int) -> list[int]:
    """`ids` cut to `max_len`, keeping the closing special tokens of a pretrained tokenizer (a BERT row
    still ends in [SEP])."""
    if len(ids) <= max_len:
        return ids
    closing = getattr(tokenizer, "closing", [])
    if not closing or len(closing) >= max_len:
        return ids[:max_len]
    return ids[:max_len - len(closing)] + closing


def has_tokenizer(directory: Path | None) -> bool:
    return directory is not None and (directory / CONFIG_FILE).is_file()


def load_tokenizer(directory: Path) -> Tokenizer:
    """Read a tokenizer saved with `save`. DataError (one line) if it is missing or corrupt."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise DataError(f"no tokenizer in {directory} ({CONFIG_FILE} missing): point at the run directory "
                        "that trained the model")
    try:
        config = json.loads(path.read_text())
        kind = config["kind"]
        if kind == "byte":
            return ByteTokenizer()
        if kind == "id":
            return IdTokenizer(int(config["symbols"]))
        if kind == "bpe":
            return BpeTokenizer(HFTokenizer.from_file(str(directory / BPE_FILE)))
        if kind == "pretrained":
            return PretrainedTokenizer.from_file(directory / BPE_FILE, int(config["pad_id"]))
    except Exception as err:  # the tokenizers library raises plain Exception on a corrupt file
        if isinstance(err, DataError):
            raise
        raise DataError(f"tokenizer in {directory} is unreadable ({err.__class__.__name__}): restore its files "
                        "from the run or delete them to rebuild") from None
    raise DataError(f"tokenizer in {directory} has unknown kind '{kind}': restore {CONFIG_FILE} from the run")
