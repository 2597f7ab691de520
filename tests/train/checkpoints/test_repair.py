"""Damaged checkpoints: named in one line, moved aside (never deleted), and the newest good step restored.

The default cases save a tiny model's TrainState at steps 10, 20, 30 with `Checkpoints`; the slow case
damages a checkpoint of a real `python -m train --config configs/tiny.yaml` run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from jaxblock import Classifier
from tests.faults.stress import array_file_it_reads
from train.checkpoints.repair import DAMAGE_NOTE, committed_steps, restore_newest_good
from train.checkpoints.store import CHECKPOINT_DIR, Checkpoints, DamagedCheckpointError, check_compatible
from train.config import Config, load_config
from train.loop.state import abstract_init, create_state

ROOT = Path(__file__).resolve().parents[3]


def _config() -> Config:
    cfg = load_config(ROOT / "configs/tiny.yaml", ["checkpoint.max_to_keep=5", "checkpoint.async_save=false"])
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": 16, "num_classes": 2})})


def _updated_states(cfg: Config, steps: tuple[int, ...]) -> dict[int, Any]:
    """What conftest.updated_state makes at each step (the state after one update with random gradients,
    so that the Adam moments are arrays worth storing), from host random parameters and gradients (seed =
    step) and one compiled update: compiling its per-leaf random draws took ~5 s, eager ones longer."""
    model = Classifier(cfg.model)
    shapes = abstract_init(model, cfg.data.buckets[-1])[0]
    update = jax.jit(lambda params, grads, step: create_state(model, params, cfg.optim, cfg.train.steps)
                     .apply_gradients(grads=grads).replace(step=step))
    out = {}
    for step in steps:
        rng = np.random.default_rng(step)
        params, grads = (jax.tree.map(lambda x: rng.normal(0, scale, x.shape).astype(x.dtype), shapes)
                         for scale in (0.1, 1.0))
        out[step] = update(params, grads, np.int32(step))
    return out


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    """Three TrainStates of distinct parameters (seed = step) and a workdir holding them as checkpoints
    10, 20, 30, made once: each test damages a copy."""
    cfg = _config()
    states = _updated_states(cfg, (10, 20, 30))
    template = tmp_path_factory.mktemp("saved")
    ckpts = Checkpoints(template, cfg.checkpoint)
    for state in states.values():
        assert ckpts.save(state, {"seed": 0, "label_names": ["a", "b"]})
    ckpts.wait()
    ckpts.close()
    return cfg, states, template


@pytest.fixture
def saved(tmp_path, states):
    """A fresh copy of the workdir with checkpoints 10, 20, 30, opened as a run opens it."""
    cfg, states, template = states
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    ckpts = Checkpoints(tmp_path, cfg.checkpoint)
    yield cfg, ckpts, states
    ckpts.close()


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                                           strict=True))


def test_truncated_array_file_is_named_moved_aside_and_the_previous_step_restored(saved, tmp_path, capfd):
    _, ckpts, states = saved
    before = {s: sorted(p.relative_to(tmp_path) for p in (ckpts.directory / str(s)).rglob("*")) for s in (10, 20)}
    damaged_file = array_file_it_reads(ckpts.directory / "30" / "params")
    os.truncate(damaged_file, 20)  # what a full disk or a dying node leaves
    capfd.readouterr()

    got = restore_newest_good(ckpts.directory, lambda s: ckpts.restore(s, states[30]))

    assert got.step == 20 and int(got.value[0].step) == 20
    assert _same(got.value[0].params, states[20].params)
    assert len(got.notes) == 1
    note = got.notes[0]
    assert "\n" not in note and note.startswith("checkpoint 30 is damaged (params/")
    assert "is not valid for value of size 20" in note  # TensorStore's reason, without its spec
    assert note.endswith("resuming from 20") and "moved to checkpoints.damaged/30-" in note
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err and "TensorStore" not in err
    # Moved whole (nothing deleted), with the full error beside it; older steps untouched.
    assert committed_steps(ckpts.directory) == [10, 20]
    (moved,) = (tmp_path / "checkpoints.damaged").iterdir()
    assert (moved / "params" / damaged_file.relative_to(ckpts.directory / "30" / "params")).stat().st_size == 20
    assert "Traceback" in (moved / DAMAGE_NOTE).read_text()
    for s in (10, 20):
        assert sorted(p.relative_to(tmp_path) for p in (ckpts.directory / str(s)).rglob("*")) == before[s]
    # The writer's manager, reloaded, continues from there: a new step 30 saves and restores.
    ckpts.manager.reload()
    assert ckpts.latest_step() == 20
    assert ckpts.save(states[30], {"seed": 0, "label_names": ["a", "b"]})
    ckpts.wait()
    assert _same(ckpts.restore(30, states[30])[0].params, states[30].params)


@pytest.mark.parametrize("damage", ["delete_array_file", "delete_item", "truncate_metadata", "opt_state_file"])
def test_other_damage_is_named_too(saved, damage):
    cfg, ckpts, states = saved
    step_dir = ckpts.directory / "30"
    if damage == "delete_array_file":
        array_file_it_reads(step_dir / "params").unlink()
    elif damage == "delete_item":
        shutil.rmtree(step_dir / "params")
    elif damage == "truncate_metadata":
        os.truncate(step_dir / "params" / "_METADATA", 5)
    else:
        os.truncate(array_file_it_reads(step_dir / "train"), 7)

    fresh = Checkpoints(ckpts.directory.parent, cfg.checkpoint)  # as a rerun opens it

    def restore(step: int):
        check_compatible(ckpts.directory.parent, step, states[30].params)  # metadata first, as the run does
        return fresh.restore(step, states[30])

    got = restore_newest_good(ckpts.directory, restore)
    assert got.step == 20 and len(got.notes) == 1 and got.notes[0].startswith("checkpoint 30 is damaged (")
    expected = {"delete_array_file": "params/", "delete_item": "params", "truncate_metadata": "params/_METADATA",
                "opt_state_file": "train/opt_state."}[damage]
    assert expected in got.notes[0]
    assert committed_steps(ckpts.directory) == [10, 20]


def test_every_step_damaged_moves_nothing_and_says_so(saved):
    _, ckpts, states = saved
    for s in (10, 20, 30):
        os.truncate(array_file_it_reads(ckpts.directory / str(s) / "params"), 3)
    with pytest.raises(DamagedCheckpointError) as err:
        restore_newest_good(ckpts.directory, lambda s: ckpts.restore(s, states[30]))
    message = str(err.value)
    assert "\n" not in message and "checkpoint 30:" in message and "checkpoint 10:" in message
    assert committed_steps(ckpts.directory) == [10, 20, 30]
    assert not (ckpts.directory.parent / "checkpoints.damaged").exists()


def test_errors_that_are_not_damage_propagate_and_move_nothing(saved):
    ckpts = saved[1]

    def wrong_shapes(step: int):
        raise ValueError("a config problem, not damage")

    with pytest.raises(ValueError, match="a config problem"):
        restore_newest_good(ckpts.directory, wrong_shapes)
    assert committed_steps(ckpts.directory) == [10, 20, 30]


def test_no_checkpoints_restores_nothing(tmp_path):
    got = restore_newest_good(tmp_path / CHECKPOINT_DIR, lambda s: pytest.fail("nothing to restore"))
    assert got.step is None and got.notes == []


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """`python -m train --config configs/tiny.yaml` (60 steps, checkpoints at 30 and 60)."""
    workdir = tmp_path_factory.mktemp("tiny-run")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "train", "--config", str(ROOT / "configs/tiny.yaml"),
                          "--workdir", str(workdir), "train.progress=false"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return workdir


RESUME = """
import json, sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from tests.conftest import updated_state
from train.checkpoints.store import Checkpoints, read_run_config
from train.checkpoints.repair import restore_newest_good
workdir = Path(sys.argv[1])
cfg = read_run_config(workdir)
ckpts, target = Checkpoints(workdir, cfg.checkpoint), updated_state(cfg)
got = restore_newest_good(workdir / "checkpoints", lambda s: ckpts.restore(s, target))
ckpts.close()
print(json.dumps({"step": got.step, "restored": int(got.value[0].step), "notes": got.notes}))
"""


@pytest.mark.slow
def test_a_trained_runs_damaged_newest_checkpoint_falls_back_to_the_previous(tiny_run, tmp_path):
    """In a fresh process, as a rerun would: one note, and nothing else on stderr."""
    workdir = tmp_path / "run"
    shutil.copytree(tiny_run, workdir)
    directory = workdir / CHECKPOINT_DIR
    assert committed_steps(directory) == [30, 60]
    intact = {p.relative_to(directory): p.read_bytes() for p in (directory / "30").rglob("*") if p.is_file()}
    # Orbax may keep the array data twice (per-process files and a merged copy in params/d; which one a
    # restore reads depends on the save): cut every array file short, as a disk filling up mid-copy would.
    for path in (directory / "60" / "params").rglob("*"):
        if path.is_file() and path.parent.name == "d" and path.stat().st_size > 1024:
            os.truncate(path, 10)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", RESUME, str(workdir), str(ROOT)], capture_output=True,
                         text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["step"] == 30 and got["restored"] == 30
    (note,) = got["notes"]
    assert note.startswith("checkpoint 60 is damaged (params/") and note.endswith("resuming from 30")
    assert committed_steps(directory) == [30]
    assert {p.relative_to(directory): p.read_bytes() for p in (directory / "30").rglob("*") if p.is_file()} == intact
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints.damaged").iterdir()] == ["60"]


@pytest.mark.parametrize("damage", ["truncate_array_file", "truncate_metadata"])
def test_a_failed_restore_leaves_no_task_behind_its_closed_event_loop(saved, monkeypatch, damage):
    """Orbax runs a restore in a fresh event loop and closes it; a read that fails first must not leave the
    restore's other reads as tasks of the closed loop: they would print "Event loop is closed" tracebacks
    whenever their TensorStore reads complete or are collected, on a slow machine after the last line."""
    import asyncio

    from train.checkpoints import event_loops

    _, ckpts, states = saved
    step_dir = ckpts.directory / "30"
    if damage == "truncate_array_file":
        os.truncate(array_file_it_reads(step_dir / "params"), 20)
    else:
        os.truncate(step_dir / "params" / "_METADATA", 5)
    left: list[asyncio.Task] = []
    close = asyncio.BaseEventLoop.close

    def counting_close(loop: asyncio.BaseEventLoop) -> None:
        left.extend(t for t in asyncio.all_tasks(loop) if not t.done())
        close(loop)

    monkeypatch.setattr(asyncio.BaseEventLoop, "close", counting_close)
    assert event_loops.installed()
    with pytest.raises(Exception):  # noqa: B017 (whatever Orbax raises for the damage)
        ckpts.restore(30, states[30])
    assert left == []
    got = restore_newest_good(ckpts.directory, lambda s: ckpts.restore(s, states[30]))
    assert got.step == 20 and left == []
