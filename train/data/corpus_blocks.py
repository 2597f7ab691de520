"""A corpus's files read lazily as blocks of texts: the random-access source every stream shard reads.

A corpus is one or many files: plain text (one example per line), JSONL (one object per line with a text
field) or ArrayRecord (one UTF-8 example per record). A text file is cut into byte ranges of about
`block_bytes` that end at a newline (found by one seek per block, so opening a multi-GB corpus reads
almost nothing and keeps no per-line index); an ArrayRecord file into runs of records.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.data.datasets import DataError

__all__ = ["FORMATS", "CorpusBlocks", "corpus_files"]

FORMATS = ("text", "jsonl", "arrayrecord")


def corpus_files(paths: Sequence[str]) -> list[Path]:
    """The corpus's files in a fixed order. DataError (one line) if a path matches nothing."""
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            found = sorted(f for f in path.iterdir() if f.is_file() and not f.name.startswith("."))
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(f) for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        if not found:
            raise DataError(f"corpus path {p} matches no file: check the path or the glob pattern")
        files.extend(found)
    return files


def _format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        if fmt not in FORMATS:
            raise DataError(f"unknown corpus format '{fmt}': use one of auto, {', '.join(FORMATS)}")
        return fmt
    suffix = path.suffix.lower()
    return "jsonl" if suffix in (".jsonl", ".json") else "arrayrecord" if suffix in (
        ".arrayrecord", ".array_record") else "text"


class CorpusBlocks:
    """A Grain random-access source: element b is the list of texts in block b (lines or records).

    Blocks are (file, start, end): byte ranges ending at a newline for text and JSONL, record ranges
    for ArrayRecord. Picklable (open files are per process and reopened lazily).
    """

    def __init__(self, files: Sequence[Path], *, fmt: str = "auto", text_field: str = "text",
                 block_bytes: int = 1 << 16, records_per_block: int = 256):
        self.files = [Path(f) for f in files]
        self.formats = [_format(f, fmt) for f in self.files]
        self.text_field = text_field
        spans: list[tuple[int, int, int]] = []
        for i, (path, kind) in enumerate(zip(self.files, self.formats, strict=True)):
            bounds = self._record_bounds(path, records_per_block) if kind == "arrayrecord" else \
                self._byte_bounds(path, block_bytes)
            spans.extend((i, a, b) for a, b in itertools.pairwise(bounds) if b > a)
        if not spans:
            raise DataError(f"the corpus ({', '.join(map(str, self.files))}) is empty: add text to it")
        self.spans = np.asarray(spans, np.int64)  # [blocks, 3]: file, start, end
        self._handles: dict[int, Any] = {}

    @staticmethod
    def _byte_bounds(path: Path, block_bytes: int) -> list[int]:
        """Block starts: 0, then just past the first newline at or after each multiple of block_bytes."""
        size = path.stat().st_size
        bounds = [0]
        with open(path, "rb") as f:
            for target in range(block_bytes, size, block_bytes):
                if target <= bounds[-1]:
                    continue
                pos = target - 1
                f.seek(pos)
                end = size
                while piece := f.read(1 << 16):
                    if (k := piece.find(b"\n")) >= 0:
                        end = pos + k + 1
                        break
                    pos += len(piece)
                if end < size:
                    bounds.append(end)
        return [*bounds, size]

    @staticmethod
    def _record_bounds(path: Path, per_block: int) -> list[int]:
        count = len(_array_record_reader(path))
        return [*range(0, count, per_block), count]

    def __len__(self) -> int:
        return len(self.spans)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    def __getitem__(self, index: int) -> list[str]:
        i, start, end = (int(v) for v in self.spans[index])
        if self.formats[i] == "arrayrecord":
            reader = self._handles.get(i) or self._handles.setdefault(i, _array_record_reader(self.files[i]))
            records = reader.read(list(range(start, end)))
            return [self._decode(r, i, start + k) for k, r in enumerate(records)]
        fd = self._handles.get(i) or self._handles.setdefault(i, os.open(self.files[i], os.O_RDONLY))
        lines = os.pread(fd, end - start, start).split(b"\n")  # pread: Grain reads blocks from threads
        if self.formats[i] == "text":
            return [self._decode(line, i, start).rstrip("\r") for line in lines if line.strip()]
        return [self._json_text(line, i, start) for line in lines if line.strip()]

    def _where(self, i: int, offset: int) -> str:
        """'file:line' of the line at byte `offset` (counted only when reporting an error)."""
        with open(self.files[i], "rb") as f:
            line = f.read(offset).count(b"\n") + 1
        return f"{self.files[i]}:{line}"

    def _decode(self, raw: bytes, i: int, offset: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{self.files[i]} near byte/record {offset} is not UTF-8 text: convert the file to "
                            "UTF-8") from None

    def _json_text(self, line: bytes, i: int, block_start: int) -> str:
        try:
            record = json.loads(line)
        except ValueError:
            raise DataError(f"{self._where(i, self._offset(i, block_start, line))} is not a JSON object: fix the "
                            "line or read the file as plain text (format text)") from None
        text = record.get(self.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{self._where(i, self._offset(i, block_start, line))} has no string field "
                            f"'{self.text_field}': add it or set the corpus text field") from None
        return text

    def _offset(self, i: int, block_start: int, line: bytes) -> int:
        with open(self.files[i], "rb") as f:
            f.seek(block_start)
            return block_start + f.read(1 << 24).find(line)


def _array_record_reader(path: Path) -> Any:
    try:
        from array_record.python.array_record_module import ArrayRecordReader
        return _Records(ArrayRecordReader(str(path)))
    except (OSError, RuntimeError, ValueError) as err:
        raise DataError(f"{path} is not a readable ArrayRecord file ({err.__class__.__name__}): check the file "
                        "or give its format explicitly") from None


class _Records:
    """Random access to an ArrayRecord file's records (the reader's own index, nothing loaded)."""

    def __init__(self, reader: Any):
        self.reader = reader

    def __len__(self) -> int:
        return int(self.reader.num_records())

    def read(self, indices: list[int]) -> list[bytes]:
        return list(self.reader.read(indices))
