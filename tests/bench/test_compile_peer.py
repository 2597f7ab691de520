"""bench/compile_peer.py without a compiler: the table and the ratios it writes, and its one-line refusals (the
compiles themselves are `python -m bench.compile_peer`, minutes per step, written to bench/records/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import compile_peer
from bench.compile_peer import GiB, Row


def _row(side: str, remat: str, temporaries: int, largest: int | None = None) -> Row:
    return Row(side, remat, 32, True, int(1.22 * GiB), temporaries, temporaries + int(1.22 * GiB), True, 60.0, largest)


def test_the_table_gives_each_side_and_our_ratio_to_the_peer_with_the_same_remat() -> None:
    rows = [_row("peer", "none", 9_950_557_696, 190), _row("ours (data=8)", "none", 4_996_225_536, 507),
            _row("peer", "on", 3_626_251_776), _row("ours (data=8)", "full", 1_567_000_000)]
    text = compile_peer.render(rows, "v5e-8", "TPU v5 lite", int(15.75 * GiB), 512)
    assert "| peer | none | 32 | 1.22 | 9.27 | 10.49 | yes | 190 | 60 |" in text
    # 0.5021: three decimals, so a ratio just above a goal of 0.5x does not print as 0.50x
    assert "- ours (data=8), remat none: 0.502x the peer's temporaries (remat none); 2.668x its largest batch" in text
    assert "- ours (data=8), remat full: 0.432x the peer's temporaries (remat on)" in text


def test_one_half_of_the_table_still_gives_its_ratios_and_never_across_policies() -> None:
    """--remat on: the with-remat rows get their ratio without a no-remat peer row; a no-remat row of ours
    with only the peer's checkpointing beside it gets none (the goals compare the same policy)."""
    rows = [_row("peer", "on", 3_626_251_776, 146), _row("ours (data=8)", "full", 1_567_000_000, 443)]
    text = compile_peer.render(rows, "v5e-8", "TPU v5 lite", int(15.75 * GiB), 512)
    assert "- ours (data=8), remat full: 0.432x the peer's temporaries (remat on); 3.034x its largest batch" in text
    lone = compile_peer.render([_row("peer", "on", 3_626_251_776), _row("ours (data=8)", "none", 4_996_225_536)],
                               "v5e-8", "TPU v5 lite", int(15.75 * GiB), 512)
    assert "x the peer's" not in lone


def test_a_missing_peer_is_one_line_naming_its_install_and_exit_2(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_peer.main(["--target", "v5e-8", "--peer-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transformers==4.46.3" in err[0]


def test_a_bad_target_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_peer.main(["--target", "v9z-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "v9z-8" in err[0]


@pytest.mark.parametrize(("args", "says"), [(["--per-chip", "0"], "0 is not a count"),
                                            (["--length", "1000"], "past BERT-base's 512 positions"),
                                            (["--per-chip", "x"], "invalid count value")])
def test_a_count_or_length_out_of_range_is_refused_before_any_compile(args: list[str], says: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_peer.main(args) == 2
    assert says in capsys.readouterr().err


def test_an_unknown_remat_half_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert compile_peer.main(["--remat", "some"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # argparse: its usage, then one error line
    assert err[-1].startswith("python -m bench.compile_peer: error: argument --remat") and "'some'" in err[-1]
