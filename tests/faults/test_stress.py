"""The timing-dependent faults, repeated (slow): a damaged newest checkpoint of every kind resumed, and
kill -9 at random moments then rerun, each counted by tests/faults/stress.py: no line that is not the
command's own, no lost or repeated step, parameters bitwise those of the uninterrupted run. The full
20 + 20 runs: `python tests/faults/stress.py --damaged 20 --kill9 20 --out DIR`."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.faults import stress as stress


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, float]:
    workdir = tmp_path_factory.mktemp("stress") / "reference"
    start = time.monotonic()
    done = stress.train(workdir)
    assert done.returncode == 0, done.stderr
    return workdir, time.monotonic() - start


def assert_clean(result: dict) -> None:
    assert result["exit_codes"] == [0], result
    assert result["foreign_lines"] == 0 and result["tracebacks"] == 0, result
    assert result["lost_steps"] == 0 and result["repeated_steps"] == 0 and result["bitwise_equal"], result


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(2))
@pytest.mark.parametrize("kind", stress.DAMAGE_KINDS)
def test_damaged_newest_checkpoint_resume_repeated(reference, tmp_path, kind, repeat):
    result = stress.damaged_resume(reference[0], tmp_path / "run", kind)
    assert_clean(result)
    assert result["moved_aside"] == 1 and result["resumed_from_15"], result


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_kill_9_at_a_random_moment_then_rerun(reference, tmp_path, seed):
    after = random.Random(seed).uniform(1.0, reference[1])
    assert_clean(stress.killed_and_rerun(reference[0], tmp_path / "run", after))
