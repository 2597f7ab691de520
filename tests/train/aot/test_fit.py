"""`compile --fit`'s search, against a stand-in for the compiler (no compile): it must return exactly the
largest batch that fits, in few probes when the peak is a line in the batch, and still exactly when it is not."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from train.aot.fit import LIMIT, Probe, _largest

GIB = 2**30


def _search(peak, usable: int, start: int) -> tuple[int, list[int]]:
    calls: list[int] = []

    def probe(n: int) -> Probe:
        calls.append(n)
        total = peak(n)
        return Probe(n, total <= usable, total, None, 0.0)

    return _largest(probe, start, lambda: usable), calls


def _truth(peak, usable: int) -> int:
    return max((n for n in range(1, LIMIT + 1) if peak(n) <= usable), default=0)


@settings(max_examples=200, deadline=None)
@given(state=st.integers(0, 20 * GIB), per_row=st.integers(1 << 16, 4 * GIB), start=st.integers(1, LIMIT),
       usable=st.sampled_from([int(15.75 * GIB), int(59.33 * GIB)]))
def test_a_linear_peak_is_found_exactly_in_few_compiles(state, per_row, start, usable):
    def peak(n: int) -> int:
        return state + per_row * n

    got, calls = _search(peak, usable, start)
    truth = _truth(peak, usable)
    assert got == truth
    # Up to 8x a step before anything fails, then at most about five compiles.
    climb = math.ceil(math.log(max(truth, start) / start, 8))
    assert len(calls) == len(set(calls)) and len(calls) <= 5 + climb, calls


@settings(max_examples=200, deadline=None)
@given(state=st.integers(0, 8 * GIB), per_row=st.integers(1 << 16, GIB), start=st.integers(1, LIMIT),
       step=st.sampled_from([1, 8, 128]), bump=st.integers(0, 2 * GIB))
def test_a_peak_that_is_no_line_is_still_found_exactly(state, per_row, start, step, bump):
    """Padding to tiles, a layout the compiler switches past some batch: monotone, not linear."""
    usable = int(15.75 * GIB)

    def peak(n: int) -> int:
        rounded = -(-n // step) * step
        return state + per_row * rounded + (bump if n > 300 else 0) + (rounded * rounded * 1024)

    got, calls = _search(peak, usable, start)
    assert got == _truth(peak, usable)
    assert len(calls) == len(set(calls)) and len(calls) <= 13 + 3 * 12, calls


def _squeezed(state: int, per_row: int, beyond: float, squeeze: float, usable: int):
    """A peak as the compilers give it near the chip's limit: a line in the batch until the compiler recomputes to
    fit, past the line's edge up to `beyond` times it, with peaks squeezed just under the limit; then programs it
    refuses with peaks squeezed just over it (`squeeze` times further), then the line again."""
    edge = int((usable - state) // per_row * beyond)
    end = int(edge * squeeze)

    def peak(n: int) -> int:
        if n <= edge:
            return min(state + per_row * n, usable - (edge - n) * 1000)
        over = usable + usable // 400 + (n - edge) * 1000
        return over if n <= end else max(over, state + per_row * n)

    return peak


@settings(max_examples=200, deadline=None)
@given(state=st.integers(0, 4 * GIB), per_row=st.integers(1 << 16, 256 << 20), start=st.integers(1, 512),
       beyond=st.floats(1.0, 1.5), squeeze=st.floats(1.0, 2.0))
def test_peaks_squeezed_against_the_limit_are_bisected_not_crawled(state, per_row, start, beyond, squeeze):
    """Near the limit the compiler recomputes to fit, and the peaks of batches either side of the edge sit
    against the limit, off the line: aiming from them moved one batch a compile (configs/
    sentiment_pretrained_accel.yaml without remat, v5e-8: 1783, 1782, 1781, 1780, ... refused at 15.75-15.79 GiB)."""
    usable = int(15.75 * GIB)
    peak = _squeezed(state, per_row, beyond, squeeze, usable)
    got, calls = _search(peak, usable, start)
    truth = _truth(peak, usable)
    assert got == truth
    climb = math.ceil(math.log(max(truth, start) / start, 8))
    assert len(calls) == len(set(calls)) and len(calls) <= 26 + climb, calls


def test_the_minilm_search_without_remat_takes_bisections_not_single_steps():
    peak = _squeezed(int(0.36 * GIB), int(0.01024 * GIB), 1.05, 1.3, int(15.75 * GIB))
    got, calls = _search(peak, int(15.75 * GIB), 4)
    assert got == _truth(peak, int(15.75 * GIB)) and len(calls) <= 20, calls


def test_nothing_fits_and_everything_fits():
    assert _search(lambda n: 20 * GIB + n, int(15.75 * GIB), 32)[0] == 0
    assert _search(lambda n: n, int(15.75 * GIB), 32)[0] == LIMIT


def test_a_batch_at_the_search_limit_is_shown_as_a_floor_not_as_the_answer():
    from train.aot.fit import Probe, Row, Table, render

    probes = [Probe(LIMIT, True, 17 * GIB, None, 1.0)]
    rows = [Row("none", LIMIT, 8 * LIMIT, 17 * GIB, None, probes), Row("full", 100, 800, 15 * GIB, None, probes)]
    table = Table("c.yaml", "h100-8", "H100", int(59.33 * GIB), 8, "m", rows)
    text = render(table)
    assert f"| none | {LIMIT}+ (the search's limit) |" in text and "| full | 100 |" in text
    data = table.to_json()
    assert data["limit"] == LIMIT and [r["at_limit"] for r in data["rows"]] == [True, False]
