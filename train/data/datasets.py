"""Where labelled examples come from: the vaderSentiment ground-truth sets, local files, synthetic tasks.

Each source returns `Examples`: texts, integer labels and the label names, before any tokenization
or splitting (train/data/labelled.py does both). Every failure is a `DataError`: one line naming the problem
and the fix.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from train.errors import DataError  # re-exported: the data modules' one error


@dataclass(frozen=True)
class Examples:
    texts: list[str]
    labels: np.ndarray  # int32[E], indices into label_names
    label_names: list[str]


# --- the vaderSentiment 3.3.2 ground-truth sets ---------------------------------------------------

VADER_PACKAGE = "vaderSentiment==3.3.2"
VADER_INNER_ARCHIVE = "additional_resources/hutto_ICWSM_2014.tar.gz"
# File name inside the inner archive -> SHA-256 of its bytes, pinned from the registry's 3.3.2 sdist.
VADER_FILES = {
    "rotten_tomatoes": "movieReviewSnippets_GroundTruth.txt",
    "tweets": "tweets_GroundTruth.txt",
    "amazon": "amazonReviewSnippets_GroundTruth.txt",
    "nyt": "nytEditorialSnippets_GroundTruth.txt",
}
VADER_SHA256 = {
    "movieReviewSnippets_GroundTruth.txt": "c8293b0d942e90e223ea2c0955d969040d1a1be514a978b9af0698940bd13350",
    "tweets_GroundTruth.txt": "dfbe7102e2f92579ed8b19df9a3822491880697c67adf712fb66e520cc05102f",
    "amazonReviewSnippets_GroundTruth.txt": "11a9807a0974a2506a2d3b4851eaf69b3d6d20688ce4923adda2312a4f6dd6c2",
    "nytEditorialSnippets_GroundTruth.txt": "7d8fbcce7dde5d716da53e78f4ef4be6b706e9ef1e1d51887e6d0ad4b69cc27e",
}
SENTIMENT_LABELS = ["negative", "positive"]

Fetcher = Callable[[Path], Path]  # download directory -> path of the sdist .tar.gz


def check_process(process_index: int, process_count: int) -> None:
    """DataError (one line) unless process `process_index` of `process_count` exists: the check every
    per-process share of the data (in-memory batches, streamed corpus shards) starts with."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process {process_index} of {process_count} is not a valid process: check "
                        "parallel.process_id and parallel.num_processes")


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxblock"


def pip_download(directory: Path) -> Path:
    """Fetch the vaderSentiment source distribution through pip (the user's index and proxy settings)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "--quiet", VADER_PACKAGE, "-d", str(directory),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DataError(f"could not run pip to fetch {VADER_PACKAGE} ({err.__class__.__name__}): "
                        "check that pip is installed and PyPI is reachable, or use data.source=synthetic") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        raise DataError(f"pip could not fetch {VADER_PACKAGE} ({reason}): check network access to PyPI "
                        "(or pip's index settings), or use data.source=synthetic or data.source=file")
    found = sorted(directory.glob("*.tar.gz"))
    if not found:
        raise DataError(f"pip fetched {VADER_PACKAGE} but left no .tar.gz source archive in {directory}: "
                        "check pip's index settings (a source distribution is required)")
    return found[0]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def extract_ground_truth(sdist: Path, checksums: dict[str, str]) -> dict[str, bytes]:
    """Open the sdist, then its inner ICWSM 2014 archive; return each ground-truth file, checksum verified."""
    try:
        with tarfile.open(sdist, "r:gz") as outer:
            inner_member = next((m for m in outer.getmembers() if m.name.endswith(VADER_INNER_ARCHIVE)), None)
            if inner_member is None:
                raise DataError(f"{sdist.name} has no {VADER_INNER_ARCHIVE}: delete it and fetch {VADER_PACKAGE} again")
            inner_file = outer.extractfile(inner_member)
            assert inner_file is not None  # a regular member, found above
            inner_bytes = inner_file.read()
        out: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:gz") as inner:
            for member in inner.getmembers():
                name = Path(member.name).name
                if name in checksums and member.isfile():
                    f = inner.extractfile(member)
                    assert f is not None
                    out[name] = f.read()
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{sdist.name} is not a readable archive ({err.__class__.__name__}): "
                        f"fetch {VADER_PACKAGE} again") from None
    for name, digest in checksums.items():
        if name not in out:
            raise DataError(f"{sdist.name} lacks {name}: fetch {VADER_PACKAGE} again")
        if _sha256(out[name]) != digest:
            raise DataError(f"{name} from {sdist.name} fails its SHA-256 check: the archive is not the "
                            f"published {VADER_PACKAGE}; check pip's index settings")
    return out


def vader_file(
    source: str, cache_dir: Path | None = None, *, fetch: Fetcher | None = None,
    checksums: dict[str, str] = VADER_SHA256,
) -> Path:
    """Path of the cached, checksum-verified ground-truth file for `source`; fetched through pip if absent.

    A cached file that fails its checksum is fetched again; `fetch` (default `pip_download`) and
    `checksums` are parameters so the archive handling can be tested offline.
    """
    cache = (cache_dir or default_cache_dir()) / "vader_3.3.2"
    name = VADER_FILES[source]
    path = cache / name
    if path.is_file() and _sha256(path.read_bytes()) == checksums[name]:
        return path
    with tempfile.TemporaryDirectory(prefix="jaxblock-vader-") as tmp:
        files = extract_ground_truth((fetch or pip_download)(Path(tmp)), checksums)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for fname, data in files.items():
            # Write-then-rename: a killed process never leaves a truncated file under the final name.
            part = cache / f".{fname}.part"
            part.write_bytes(data)
            os.replace(part, cache / fname)
    except OSError as err:
        raise DataError(f"cannot write the data cache {cache} ({err.strerror}): set data.cache_dir to a "
                        "writable directory") from None
    return path


def parse_ground_truth(path: Path) -> Examples:
    """`id<TAB>mean rating<TAB>sentence` lines (CRLF): positive if mean > 0, negative if < 0, 0 dropped."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 (byte {err.start}): delete it to fetch it again") from None
    texts: list[str] = []
    labels: list[int] = []
    # Split on line ends only: str.splitlines would also break sentences at \x0b, \x1c, \u2028.
    for lineno, line in enumerate(text.replace("\r\n", "\n").split("\n"), start=1):
        if not line.strip():
            continue
        parts = line.split("\t", 2)
        try:
            rating = float(parts[1])
        except (IndexError, ValueError):
            raise DataError(f"{path} line {lineno}: expected id<TAB>rating<TAB>text: delete the file to "
                            "fetch it again") from None
        sentence = parts[2].strip() if len(parts) == 3 else ""
        if not sentence:
            raise DataError(f"{path} line {lineno}: empty sentence: delete the file to fetch it again")
        if rating == 0:
            continue  # neither polarity: the published rule drops it
        texts.append(sentence)
        labels.append(int(rating > 0))
    return Examples(texts, np.asarray(labels, np.int32), list(SENTIMENT_LABELS))


def load_vader(source: str, cache_dir: Path | None = None) -> Examples:
    return parse_ground_truth(vader_file(source, cache_dir))


# --- local CSV / TSV / JSONL -------------------------------------------------------------------

_SUFFIX_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def file_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    found = _SUFFIX_FORMATS.get(path.suffix.lower())
    if found is None:
        raise DataError(f"cannot tell the format of {path} from its suffix '{path.suffix}': name it .csv, .tsv "
                        "or .jsonl, or set data.format=csv|tsv|jsonl")
    return found


def _delimited_rows(
    path: Path, text: str, delimiter: str, text_col: str, label_col: str
) -> Iterator[tuple[int, str, str]]:
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    try:
        header = next(reader)
        missing = [c for c in (text_col, label_col) if c not in header]
        if missing:
            key = "data.text_column" if missing[0] == text_col else "data.label_column"
            raise DataError(f"{path} has no column '{missing[0]}' (columns: {', '.join(header)}): set {key} "
                            "to one of them or add the column")
        ti, li = header.index(text_col), header.index(label_col)
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise DataError(f"{path} line {reader.line_num}: {len(row)} fields but the header has "
                                f"{len(header)}: quote fields that contain '{delimiter}' or fix the row")
            yield reader.line_num, row[ti], row[li]
    except csv.Error as err:
        raise DataError(f"{path} line {reader.line_num}: malformed row ({err}): fix the quoting") from None


def _jsonl_rows(path: Path, text: str, text_col: str, label_col: str) -> Iterator[tuple[int, str, str]]:
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path} line {lineno}: not valid JSON ({err.msg}, column {err.colno}): "
                            "write one JSON object per line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path} line {lineno}: a JSON {type(obj).__name__}, not an object: write one "
                            "JSON object per line")
        for col, key in ((text_col, "data.text_column"), (label_col, "data.label_column")):
            if col not in obj:
                raise DataError(f"{path} line {lineno} has no key '{col}' (keys: {', '.join(obj)}): set {key} "
                                "or add the key")
        label = obj[label_col]
        yield lineno, str(obj[text_col]), (json.dumps(label) if isinstance(label, bool) else str(label))


def _label_order(names: set[str]) -> list[str]:
    """Sorted distinct labels; integers in numeric order (so "2" comes before "10")."""
    def key(name: str) -> tuple[int, float, str]:
        try:
            return (0, float(int(name)), name)
        except ValueError:
            return (1, 0.0, name)
    return sorted(names, key=key)


def load_file(path: Path, fmt: str, text_column: str, label_column: str, labels: list[str] | None) -> Examples:
    if not path.is_file():
        raise DataError(f"data file {path} not found: set data.path to an existing CSV/TSV/JSONL file")
    kind = file_format(path, fmt)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start}): re-save it as UTF-8") from None
    except OSError as err:
        raise DataError(f"cannot read {path} ({err.strerror}): check its permissions") from None
    if not text.strip():
        raise DataError(f"data file {path} is empty: give it a header and one example per row")
    if kind == "jsonl":
        rows = _jsonl_rows(path, text, text_column, label_column)
    else:
        rows = _delimited_rows(path, text, "," if kind == "csv" else "\t", text_column, label_column)
    texts: list[str] = []
    raw_labels: list[str] = []
    for lineno, txt, label in rows:
        if not txt.strip():
            raise DataError(f"{path} line {lineno}: empty text in column '{text_column}': fill it or drop the row")
        label = label.strip()
        if not label:
            raise DataError(f"{path} line {lineno}: empty label in column '{label_column}': fill it or drop the row")
        if labels is not None and label not in labels:
            raise DataError(f"{path} line {lineno}: label '{label}' is not in data.labels {labels}: add it to "
                            "data.labels or fix the row")
        texts.append(txt)
        raw_labels.append(label)
    if not texts:
        raise DataError(f"data file {path} has a header but no examples: add one example per row")
    names = list(labels) if labels is not None else _label_order(set(raw_labels))
    if len(names) < 2:
        raise DataError(f"{path} has only the label {names}: a classifier needs at least 2 classes")
    index = {name: i for i, name in enumerate(names)}
    return Examples(texts, np.asarray([index[lb] for lb in raw_labels], np.int32), names)


# --- synthetic tasks that need attention -------------------------------------------------------

SYNTHETIC_LABELS = {
    "pair_match": ["no_match", "match"],
    "majority": ["not_majority", "majority"],
}


def _pair_match_bags(rng: np.random.Generator, size: int, vocab: int, length: int) -> np.ndarray:
    # Every bag holds a singleton s and a token r seen at least twice, whichever the label: s once,
    # r twice, and the other length-3 symbols drawn from every symbol but s.
    s = rng.integers(0, vocab, size=size)
    r = (s + rng.integers(1, vocab, size=size)) % vocab
    fill = rng.integers(0, vocab - 1, size=(size, length - 3))
    fill = fill + (fill >= s[:, None])  # skip s
    return np.concatenate([s[:, None], r[:, None], r[:, None], fill], axis=1)  # [E, L]


def _majority_bags(rng: np.random.Generator, size: int, vocab: int, length: int) -> np.ndarray:
    bags = rng.integers(0, vocab, size=(size, length))  # [E, L]
    counts = _counts(bags, vocab)  # [E, V]
    tied = counts == counts.max(1, keepdims=True)
    mode = np.argmax(np.where(tied, rng.random(tied.shape), -1.0), axis=1)  # a random one of the tied
    # Break ties: the first occurrence of every rival tied symbol becomes the mode.
    onehot = bags[..., None] == np.arange(vocab)  # [E, L, V]
    first_seen = np.take_along_axis(np.cumsum(onehot, axis=1, dtype=np.int16), bags[..., None], axis=2)[..., 0] == 1
    rival = np.take_along_axis(tied, bags, axis=1) & (bags != mode[:, None])
    bags = np.where(first_seen & rival, mode[:, None], bags)
    redo = np.all(bags == mode[:, None], axis=1)  # a bag of one symbol would allow only one label
    if redo.any():
        bags[redo] = _majority_bags(rng, int(redo.sum()), vocab, length)
    return bags


def _counts(bags: np.ndarray, vocab: int) -> np.ndarray:
    return np.sum(bags[..., None] == np.arange(vocab), axis=1)  # [E, V]


def synthetic_examples(task: str, size: int, vocab: int, length: int, seed: int) -> Examples:
    """Rows of `length` symbols in [0, vocab), written as space-separated integers, labels balanced.

    pair_match: 1 if the first symbol appears again later in the row. majority: 1 if the first symbol is
    the row's strict most frequent symbol. The bag of symbols is drawn with the same distribution for both
    labels and only the choice of the first symbol depends on the label, so token counts carry no signal
    at all: a bag-of-tokens model is at chance, and a model must relate position 0 to the rest.
    """
    if task not in SYNTHETIC_LABELS:
        raise DataError(f"unknown synthetic task '{task}': set data.synthetic_task to one of "
                        f"{sorted(SYNTHETIC_LABELS)}")
    rng = np.random.default_rng([seed, 0x5EED])
    labels = rng.permutation(np.arange(size) % 2).astype(np.int32)
    bags = (_pair_match_bags if task == "pair_match" else _majority_bags)(rng, size, vocab, length)  # [E, L]
    counts = _counts(bags, vocab)  # [E, V]
    per_token = np.take_along_axis(counts, bags, axis=1)  # [E, L] count of each position's symbol
    if task == "pair_match":
        qualifies = np.where(labels[:, None] == 1, per_token >= 2, per_token == 1)
    else:
        top = counts.max(1, keepdims=True)
        qualifies = np.where(labels[:, None] == 1, per_token == top, per_token < top)
    # An occurrence of a qualifying symbol goes first (a random one); the rest follow in random order.
    first = np.argmax(np.where(qualifies, rng.random(bags.shape), -1.0), axis=1)
    keys = rng.random(bags.shape)
    keys[np.arange(size), first] = -1.0
    rows = np.take_along_axis(bags, np.argsort(keys, axis=1), axis=1)
    texts = [" ".join(map(str, row)) for row in rows.tolist()]
    return Examples(texts, labels, list(SYNTHETIC_LABELS[task]))
