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
