"""train/aot/programs.py's reading of the compiler's dump, on files written as XLA writes them (no compiler)."""

from __future__ import annotations

from pathlib import Path

from train.aot.programs import MemoryReport

LIVE_RANGE = """HloLiveRange (max 1111):
  InstructionSequence:
    0:partition-id.6.0
  Live ranges at 388 (peak):
    input_add_reduce_fusion.1{1}: 100663296 bytes (cumulative: 100663296 bytes)
  Stack trace breakdown for peak usage: 1 865 873 228 bytes
    main.202_spmd (100.0%, total: 1 865 873 228 bytes, current: 0 bytes, remaining: 1 865 873 228 bytes)
"""

USAGE = """Memory Space: default (color=0)
Total bytes: 2389721485 (2.23GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
  465.74MiB( 19%);  465.74MiB;            0;               19; bf16[32,512,3,12,64], f32[32,125,30523], u32[8], 2×s8[8]
  561.74MiB( 23%);   96.00MiB;    488368128;                3; bf16[16384,2304], bf16[30523,768]
"""


def test_the_live_bytes_at_the_peak_and_the_largest_buffers_come_from_the_compilers_files(tmp_path: Path) -> None:
    stem = "module_0001.jit_train.sm_9.0a_gpu_after_optimizations"
    (tmp_path / f"{stem}-live-range.txt").write_text(LIVE_RANGE)
    (tmp_path / f"{stem}-memory-usage-report.txt").write_text(USAGE)
    report = MemoryReport(str(tmp_path))
    assert report.live_at_peak() == 1_865_873_228
    assert report.largest(2) == ["465.74MiB: bf16[32,512,3,12,64], f32[32,125,30523], u32[8], ...",
                                 "96.00MiB: bf16[16384,2304], bf16[30523,768]"]


def test_without_live_ranges_there_is_no_figure(tmp_path: Path) -> None:
    (tmp_path / "module_0001.jit_train.live-range.txt").write_text("HloLiveRange (max 3):\n")
    assert MemoryReport(str(tmp_path)).live_at_peak() is None
    assert MemoryReport(str(tmp_path / "none")).largest() == []


def test_only_a_classifier_is_told_its_classes_were_assumed() -> None:
    """The resolved shapes note 2 assumed classes for a classifier whose labels are unknown, never for the
    masked-LM head, which has none."""
    from tests.conftest import ROOT
    from train.aot import shapes

    mlm = shapes.resolve(str(ROOT / "configs" / "bert_base_mlm_l512.yaml"), [], 8, fixed_devices=True)
    assert not any(note.startswith("classes") for note in mlm.notes)
    assert any(note.startswith("vocabulary: 30522") for note in mlm.notes)
    own = shapes.resolve(str(ROOT / "configs" / "tiny.yaml"), ["data.source=file", "data.path=x.csv"], 8,
                         fixed_devices=True)
    assert any(note.startswith("classes: 2 assumed") for note in own.notes)
