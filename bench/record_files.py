"""Where the benchmarks' records go: bench/records/<stem>.md, never over an earlier record."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "records"


def free_name(stem: str, folder: Path = RECORDS) -> Path:
    """folder/stem.md, or the first of stem-2.md, stem-3.md, ... not yet taken: a record is never overwritten."""
    out, n = folder / f"{stem}.md", 1
    while out.exists():
        n += 1
        out = folder / f"{stem}-{n}.md"
    return out


def write_record(stem: str, title: str, command: str, argv: list[str] | None, text: str) -> Path:
    """bench/records/<stem>-<today>.md (free_name): the title, the command line that wrote it (`command` and
    `argv`, or this process's arguments), then `text`. Says where it went on stderr."""
    out = free_name(f"{stem}-{datetime.date.today().isoformat()}")
    arguments = " ".join(argv if argv is not None else sys.argv[1:])
    out.write_text(f"# {title}\n\nWritten by `{command} {arguments}`.\n\n{text}\n")
    print(f"wrote {out}", file=sys.stderr)
    return out
