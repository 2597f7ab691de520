"""Where the benchmarks' records go: bench/records/<stem>.md, never over an earlier record."""

from __future__ import annotations

from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "records"


def free_name(stem: str, folder: Path = RECORDS) -> Path:
    """folder/stem.md, or the first of stem-2.md, stem-3.md, ... not yet taken: a record is never overwritten."""
    out, n = folder / f"{stem}.md", 1
    while out.exists():
        n += 1
        out = folder / f"{stem}-{n}.md"
    return out
