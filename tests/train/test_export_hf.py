"""`python -m train export --format hf` (train/export_hf.py) writes its directory without transformers'
progress bars. What transformers reads back from it is tests/train/test_export.py's (slow)."""

from __future__ import annotations

import pytest

from tests.conftest import random_bert_dir

# Shares one xdist worker with the other files that build transformers models (tests/conftest.py).
XDIST_GROUP = "transformers"


def test_format_hf_writes_its_directory_without_progress_bars(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from jaxblock.interop.hf import from_hf
    from train.export_hf import write_hf_dir
    from train.init_from.hf import hf_source

    path = random_bert_dir(tmp_path / "bert")
    source = hf_source(f"hf:{path}")
    model, encoder = from_hf(path, max_len=16)
    capsys.readouterr()  # random_bert_dir's own save_pretrained shows its bar
    write_hf_dir(model, encoder["params"], source.tokenizer, [], 16, tmp_path / "hf")
    assert capsys.readouterr().err == ""
    assert (tmp_path / "hf/model.safetensors").is_file()
    assert transformers.utils.logging.is_progress_bar_enabled()  # as it was: only the export is quiet
