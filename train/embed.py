"""Sentence embeddings from a pretrained checkpoint, pooled the checkpoint's own way.

    python -m train embed --model hf:all-MiniLM-L6-v2 --input texts.txt --out vectors.npy
    python -m train embed --model hf:<dir> "a sentence" "another" --out vectors.jsonl
    from train.embed import embed; vectors = embed(["a sentence"], "hf:all-MiniLM-L6-v2")  # float32 [N, D]

The model is a transformers checkpoint directory or a packaged name (train/init_from/packaged.py), read
as `model.init_from=hf:...` reads it. Its pooling is what a sentence-transformers directory states:
modules.json lists a Pooling module (its config.json: CLS, mean, max, mean/sqrt(len), weighted mean or
last token, several concatenated in sentence-transformers' order) and optionally a Normalize module
(unit length). A directory without them is pooled by the mean over real tokens, unnormalised, as
sentence-transformers does for a plain transformers model. Texts are truncated to the checkpoint's
max_seq_length (sentence_bert_config.json) or its positions, sorted by length, and padded by our
tokenizer path to a few bucket lengths (each compiles once). Output: .npy (float32 [N, D]) or .jsonl
({"text", "embedding"} per line), written whole under a temporary name and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.config import EncoderConfig
from jaxblock.model import Encoder
from train.config import ConfigError
from train.data.datasets import DataError
from train.data.labelled import bucket_length, pad_rows
from train.data.tokenizer import PretrainedTokenizer, truncate

# sentence-transformers' Pooling config keys, in the order its concatenation uses.
POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_weightedmean_tokens": "weighted_mean",
    "pooling_mode_lasttoken": "last",
}
_IGNORED_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]  # of POOLING_KEYS' values, concatenated in this order
    normalize: bool
    source: str  # where it was read from, for the status line


def read_pooling(path: Path) -> Pooling:
    """The pooling a (sentence-transformers) checkpoint directory states; mean, unnormalised, if none."""
    modules: list[dict[str, Any]] = []
    if (path / "modules.json").is_file():
        modules = _json(path / "modules.json")
        if not isinstance(modules, list):
            raise ConfigError(f"{path / 'modules.json'} is not a list of modules: restore the checkpoint's file")
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _IGNORED_MODULES:
            raise ConfigError(f"{path} adds a {kind} module after pooling (modules.json), which embed does not "
                              "apply: use a checkpoint whose modules are Transformer, Pooling and Normalize")
    pooling_dirs = [m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling")]
    pooling_file = path / (pooling_dirs[0] if pooling_dirs else "1_Pooling") / "config.json"
    normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    if not pooling_file.is_file():
        return Pooling(("mean",), normalize, "no Pooling module: mean over tokens, as sentence-transformers")
    raw = _json(pooling_file)
    modes = tuple(mode for key, mode in POOLING_KEYS.items() if raw.get(key))
    if not modes and raw.get("pooling_mode") in POOLING_KEYS.values():  # the short form some configs use
        modes = (str(raw["pooling_mode"]),)
    if not modes:
        raise ConfigError(f"{pooling_file} sets no pooling mode we know ({', '.join(POOLING_KEYS)}): fix the file")
    if raw.get("include_prompt") is False:
        raise ConfigError(f"{pooling_file} pools without the prompt tokens (include_prompt: false), which embed does "
                          "not do: use a checkpoint that pools every token")
    return Pooling(modes, normalize, str(pooling_file.relative_to(path)) + (" + Normalize" if normalize else ""))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not readable JSON ({err.__class__.__name__}): restore the checkpoint's file"
                          ) from None


def pool(hidden: jax.Array, valid: jax.Array, pooling: Pooling) -> jax.Array:
    """[N, L, D] hidden states and bool[N, L] (real tokens first) -> [N, D * len(modes)] float32."""
    x = hidden.astype(jnp.float32)
    mask = valid[..., None].astype(jnp.float32)  # [N, L, 1]
    count = jnp.maximum(jnp.sum(mask, axis=1), 1e-9)  # [N, 1]
    parts = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(x[:, 0])
        elif mode == "max":
            parts.append(jnp.max(jnp.where(mask > 0, x, -1e9), axis=1))
        elif mode == "mean":
            parts.append(jnp.sum(x * mask, axis=1) / count)
        elif mode == "mean_sqrt_len":
            parts.append(jnp.sum(x * mask, axis=1) / jnp.sqrt(count))
        elif mode == "weighted_mean":
            w = mask * jnp.arange(1, x.shape[1] + 1, dtype=jnp.float32)[None, :, None]
            parts.append(jnp.sum(x * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1e-9))
        else:  # last: the last real token
            last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
            parts.append(jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0])
    out = jnp.concatenate(parts, axis=-1)
    if pooling.normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out


class Embedder:
    """A checkpoint's encoder, tokenizer and pooling; `embed(texts)` gives float32 [N, D]."""

    def __init__(self, model: EncoderConfig, params: Any, tokenizer: PretrainedTokenizer, pooling: Pooling,
                 max_len: int, directory: Path):
        self.model, self.params, self.tokenizer, self.pooling = model, params, tokenizer, pooling
        self.max_len, self.directory = max_len, directory
        self.buckets = sorted({b for b in (16, 32, 64, 128, 256, 512) if b < max_len} | {max_len})
        encoder = Encoder(model)

        def forward(p: Any, tokens: jax.Array, valid: jax.Array) -> jax.Array:
            hidden: jax.Array = encoder.apply({"params": p}, tokens, valid)  # type: ignore[assignment]
            return pool(hidden, valid, pooling)

        self._forward = jax.jit(forward)

    @classmethod
    def load(cls, spec: str, max_len: int | None = None) -> Embedder:
        """`spec`: hf:<dir or packaged name>, or a directory. ConfigError (one line) if unusable."""
        from train.init_from import HF_PREFIX
        from train.init_from.hf import hf_source

        spec = spec if spec.startswith(HF_PREFIX) else HF_PREFIX + spec
        try:
            source = hf_source(spec)
        except ConfigError as err:  # its lines speak of model.init_from; here the flag is --model
            raise ConfigError(str(err).replace(f"model.init_from={spec}", f"--model {spec}")) from None
        directory = Path(source.record["path"])
        assert isinstance(source.tokenizer, PretrainedTokenizer)  # an hf: source always brings tokenizer.json
        pooling = read_pooling(directory)
        positions = source.model.max_len
        limit = positions
        if (directory / "sentence_bert_config.json").is_file():
            limit = int(_json(directory / "sentence_bert_config.json").get("max_seq_length") or positions)
        if max_len is not None:
            if not 0 < max_len <= positions:
                raise ConfigError(f"--max-len {max_len} is outside the checkpoint's 1..{positions} positions: pick a "
                                  "length within them")
            limit = max_len
        limit = min(limit, positions)
        model = source.model.model_copy(update={"max_len": limit})
        encoder = dict(source.encoder)
        if "pos_embedding" in encoder:
            encoder["pos_embedding"] = encoder["pos_embedding"][: limit + model.embedding.position_offset]
        params = jax.tree.map(jnp.asarray, encoder)
        return cls(model, params, source.tokenizer, pooling, limit, directory)

    def rows(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        """Token ids per text (truncated to max_len) and how many were truncated."""
        full = [self.tokenizer.encode(t) for t in texts]
        cut = sum(len(ids) > self.max_len for ids in full)
        return [np.asarray(truncate(self.tokenizer, ids, self.max_len), np.int32) for ids in full], cut

    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """float32 [len(texts), D]: batches of similar length, the last topped up with empty rows."""
        if not texts:
            raise DataError("no text to embed: pass one or more texts")
        blank = next((i for i, text in enumerate(texts) if not text.strip()), None)
        if blank is not None:  # a pretrained tokenizer gives [CLS] [SEP] for it: a vector of nothing
            raise DataError(f"text {blank + 1} is empty or only whitespace: pass a text to embed")
        rows, _ = self.rows(texts)
        order = np.argsort([len(r) for r in rows], kind="stable")
        out: np.ndarray | None = None
        for start in range(0, len(rows), batch_size):
            take = order[start:start + batch_size]
            batch = [rows[i] for i in take] + [np.zeros(1, np.int32)] * (batch_size - len(take))
            tokens, valid = pad_rows(batch, bucket_length(max(len(r) for r in batch), self.buckets),
                                 self.tokenizer.pad_id)
            vectors = np.asarray(self._forward(self.params, tokens, valid))[: len(take)]
            if out is None:
                out = np.zeros((len(rows), vectors.shape[1]), np.float32)
            out[take] = vectors
        assert out is not None
        return out


def embed(texts: list[str], model: str = "hf:all-MiniLM-L6-v2", *, batch_size: int = 32,
          max_len: int | None = None) -> np.ndarray:
    """float32 [len(texts), D] sentence embeddings from `model` (hf:<dir or packaged name>)."""
    return Embedder.load(model, max_len).embed(texts, batch_size)


# --- the command ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from train.cli import Parser, program

    p = Parser(prog=f"{program()} embed", description="Sentence embeddings from a pretrained checkpoint, with its "
                "own pooling (sentence-transformers' modules.json / 1_Pooling), written as .npy or .jsonl.")
    p.add_argument("--model", required=True, help="hf:<checkpoint dir>, a directory, or a packaged name such as "
                   "hf:all-MiniLM-L6-v2 (fetched and checked on first use)")
    p.add_argument("--input", help="read texts from this file, one per line (- for standard input)")
    p.add_argument("--out", required=True, help="FILE.npy (float32 [N, D], input order) or FILE.jsonl")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-len", type=int, help="tokens kept per text (default: the checkpoint's max_seq_length)")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (with or instead of --input)")
    return p


def _read_texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.texts)
    if args.input is not None:
        try:
            text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"cannot read --input {args.input} ({getattr(err, 'strerror', None) or err}): pass a "
                            "readable UTF-8 text file, one text per line") from None
        texts += [line for line in text.splitlines() if line.strip()]
    if not texts:
        raise DataError("no text to embed: pass texts, --input FILE or --input - (standard input)")
    return texts


def _write(path: Path, texts: list[str], vectors: np.ndarray) -> None:
    part = path.with_name(f".{path.name}.part")
    try:
        if path.suffix == ".npy":
            with open(part, "wb") as f:
                np.save(f, vectors)
        else:
            with open(part, "w", encoding="utf-8") as f:
                for text, vec in zip(texts, vectors.tolist(), strict=True):
                    f.write(json.dumps({"text": text, "embedding": vec}) + "\n")
        os.replace(part, path)
    except OSError as err:
        part.unlink(missing_ok=True)
        raise DataError(f"cannot write --out {path} ({err.strerror}): pass a writable path") from None


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    out = Path(args.out)
    if out.suffix not in (".npy", ".jsonl"):
        raise ConfigError(f"--out {out}: name it .npy (an array) or .jsonl (one JSON object per text)")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {out.parent} does not exist: create it or pick another path")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1")
    texts = _read_texts(args)
    embedder = Embedder.load(args.model, args.max_len)
    _, cut = embedder.rows(texts)
    vectors = embedder.embed(texts, args.batch_size)
    _write(out, texts, vectors)
    pooled = "+".join(embedder.pooling.modes) + (", normalised" if embedder.pooling.normalize else "")
    print(f"embedded {len(texts)} texts into {out}: float32 [{vectors.shape[0]}, {vectors.shape[1]}], pooling "
          f"{pooled} from {embedder.pooling.source}; {cut} truncated to {embedder.max_len} tokens")
    return 0
