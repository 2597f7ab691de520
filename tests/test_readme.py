"""The README's tour: its usage example runs and shows what it says; its equations are the code's."""

import contextlib
import io
import re
from pathlib import Path

import numpy as np

import jaxblock.block

README = Path(__file__).resolve().parents[1] / "README.md"


def _tour() -> str:
    text = README.read_text(encoding="utf-8")
    assert "\n## Tour\n" in text, "README.md has no '## Tour' section"
    return text.split("\n## Tour\n", 1)[1].split("\n## ", 1)[0]


def test_tour_usage_example_runs_and_padding_is_invisible():
    blocks = re.findall(r"```python\n(.*?)```", _tour(), flags=re.DOTALL)
    assert len(blocks) == 1, "the tour should hold exactly one python example"
    assert len(blocks[0].strip().splitlines()) <= 16
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], "README.md#tour", "exec"), namespace)
    logits = np.asarray(namespace["logits"])
    assert logits.shape == (2, 2) and logits.dtype == np.float32 and np.all(np.isfinite(logits))
    np.testing.assert_allclose(np.asarray(namespace["repadded"]), logits, atol=1e-6)
    assert np.abs(np.asarray(namespace["train_logits"]) - logits).max() > 1e-4  # dropout really ran
    assert out.getvalue().startswith("(2, 2) 0.0")  # what the example's comment promises


def test_tour_equations_are_the_ones_in_the_code():
    tour = _tour()
    doc = jaxblock.block.__doc__ or ""
    for eq in (
        "U = X + Drop(MHA(LN1(X)))",
        "Y = U + Drop(FFN(LN2(U)))",
        "U = LN1(X + Drop(MHA(X)))",
        "Y = LN2(U + Drop(FFN(U)))",
    ):
        assert eq in tour and eq in doc, eq
    assert "True = a real token" in tour and "True = ignore" in tour
