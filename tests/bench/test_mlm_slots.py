"""bench/mlm_slots.py: the chosen-count table it prints for a config's data, and its one-line refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench import mlm_slots

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_gives_each_slot_count_what_its_cap_drops() -> None:
    chosen = np.array([8, 9, 10, 10, 12])
    stats = {"chosen": chosen, "real": np.full(5, 64), "examples": np.array([2, 3, 3, 4, 5])}
    text = mlm_slots.render(stats, "c.yaml", 10, 17, 64)
    assert "chosen a row (no cap): mean 9.80, sd 1.33, max 12" in text
    assert "| 10 (in use) | 0.20000 | 0.040816 |" in text  # one row over 10, by 2 of 49 chosen tokens
    assert "| 12 | 0.00000 | 0.000000 |" in text and "| 17 | 0.00000 | 0.000000 |" in text


def test_a_config_reads_its_own_stream_with_the_cap_lifted(capsys: pytest.CaptureFixture[str]) -> None:
    """Over a cap of 3 slots the rows of pretrain_tiny choose more: the cap lifted, the counts say so."""
    assert mlm_slots.main(["--config", str(ROOT / "configs" / "pretrain_tiny.yaml"), "--batches", "1",
                           "mlm.predictions_per_row=3", "data.corpus_bytes=200000",
                           "data.bpe_sample_bytes=100000"]) == 0
    out = capsys.readouterr().out
    assert "P in use: 3\n" in out
    over = [line for line in out.splitlines() if line.startswith("| 3 (in use) |")]
    assert over and float(over[0].split("|")[2]) > 0.5


@pytest.mark.parametrize("argv, says", [(["--config", "configs/sentiment.yaml", "--batches", "1"], "task=mlm"),
                                        (["--config", "configs/pretrain_tiny.yaml", "--batches", "0"], "--batches"),
                                        (["--config", "nowhere.yaml"], "nowhere.yaml")])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], says: str, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert mlm_slots.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_record_names_the_command_that_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import record_files

    monkeypatch.setattr(record_files, "RECORDS", tmp_path)
    monkeypatch.setattr(record_files.free_name, "__defaults__", (tmp_path,))
    first = record_files.write_record("mlm-slots-c", "Title", "python -m bench.mlm_slots", ["--config", "c"], "body")
    second = record_files.write_record("mlm-slots-c", "Title", "python -m bench.mlm_slots", ["--config", "c"], "b")
    assert first.read_text() == "# Title\n\nWritten by `python -m bench.mlm_slots --config c`.\n\nbody\n"
    assert second != first and second.name.endswith("-2.md")  # a record is never overwritten
