"""bench/e2e.py's arguments and its record's name (the runs themselves are minutes each: `python -m bench.e2e`)."""

from __future__ import annotations

import argparse

import pytest

from bench import e2e
from bench.record_files import free_name


def test_a_side_splits_into_revision_overrides_and_environment() -> None:
    side = e2e.parse_side("plain=HEAD:model.block.gradients=plain,JAXBLOCK_HUGE_PAGES=on")
    assert (side.name, side.rev) == ("plain", "HEAD")
    assert side.overrides == ["model.block.gradients=plain"] and side.env == {"JAXBLOCK_HUGE_PAGES": "on"}
    for bad in ("HEAD", "x=", "x=HEAD:nokey"):
        with pytest.raises(argparse.ArgumentTypeError, match="--side"):
            e2e.parse_side(bad)


def test_a_record_is_never_overwritten(tmp_path) -> None:
    first = free_name("e2e-main-2026-12-04", tmp_path)
    assert first.name == "e2e-main-2026-12-04.md"
    first.write_text("kept")
    second = free_name("e2e-main-2026-12-04", tmp_path)
    assert second.name == "e2e-main-2026-12-04-2.md" and first.read_text() == "kept"
