"""The run's tokenizer as a `tokenizers.Tokenizer`: the `tokenizer.json` of an export (train/export.py)
and of a transformers directory (train/export_hf.py), giving the run's own ids."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from train.data.tokenizer import BPE_FILE
from train.errors import ConfigError


def exported_tokenizer(tokenizer: Any, max_len: int) -> Any:
    """The run's tokenizer as a `tokenizers.Tokenizer` giving the same ids, set to truncate to `max_len`
    (keeping a pretrained tokenizer's closing special tokens, as train.data.tokenizer.truncate does) and to
    pad a batch to its longest text with the padding id."""
    from tokenizers import Tokenizer as HFTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(Path(tmp))
        path = Path(tmp) / BPE_FILE  # what our bpe and pretrained tokenizers save
        hf = HFTokenizer.from_file(str(path)) if path.is_file() else _rebuilt(tokenizer)
    hf.no_padding()
    hf.enable_truncation(max_length=max_len)
    pad_token = hf.id_to_token(tokenizer.pad_id) or "<pad>"
    hf.enable_padding(pad_id=tokenizer.pad_id, pad_token=pad_token)
    return hf


def _rebuilt(tokenizer: Any) -> Any:
    """A tokenizers.Tokenizer for our tokenizers that have no tokenizer.json: bytes (each UTF-8 byte its
    own token, id byte + 3) and the synthetic tasks' integer symbols (id symbol + 2, anything else <unk>;
    integers as the synthetic rows write them: "07" or a non-ASCII digit is <unk> here, a symbol there)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    if tokenizer.kind == "byte":
        vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2}
        vocab |= {_byte_char(b): b + tokenizer.offset for b in range(256)}
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        hf.decoder = decoders.ByteLevel()
        return hf
    if tokenizer.kind == "id":
        vocab = {"<pad>": 0, "<unk>": 1} | {str(i): i + tokenizer.offset for i in range(tokenizer.symbols)}
        hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return hf
    raise ConfigError(f"the run's tokenizer is of kind '{tokenizer.kind}', which export cannot write as a "
                      "tokenizer.json: export a run trained with a bpe, byte or pretrained tokenizer")


def _byte_char(b: int) -> str:
    """The character GPT-2's byte-level alphabet (tokenizers' ByteLevel) stands byte `b` for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))
