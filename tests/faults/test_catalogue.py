"""The fault catalogue (docs/training.md, "Faults and what a run does"): each fault, the exit code and the one line the
command prints, no traceback, and nothing lost — metrics steps each recorded once, older checkpoints
intact, and a run that continues ends with parameters bitwise equal to an uninterrupted run.

Real `python -m train` processes are interrupted, killed and starved of disk (slow); the damaged-checkpoint
reads and the NaN-padding run go through the CLI's `main` or `run.train` in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.conftest import STANDARD, PassThrough
from tests.faults.stress import DAMAGE_KINDS, foreign_lines
from tests.faults.stress import damage as damage_kind
from train import run
from train.__main__ import main
from train.checkpoints.repair import DAMAGE_NOTE, committed_steps
from train.checkpoints.restore import restore_run
from train.checkpoints.store import latest_step
from train.workdir.metrics_log import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")
# The catalogue's run: 20 steps, a checkpoint and validation every 5, a log row every step.
ARGS = ("parallel.strategy=single", "train.progress=false", "train.steps=20", "checkpoint.every=5",
        "checkpoint.max_to_keep=10", "train.log_every=1", "train.eval_every=5")
# A wider model whose saves take long enough to be caught in the act.
WIDE = ("parallel.strategy=single", "train.progress=false", "train.steps=20", "checkpoint.every=10",
        "checkpoint.max_to_keep=5", "train.log_every=1", "train.eval_every=10", "model.block.model_dim=256",
        "model.block.ffn_dim=1024", "model.num_layers=4")
NOISE = ("Traceback", "Exception ignored", "ERROR:absl", "Save Finalize", "Event loop is closed",
         "leaked shared_memory", "Warning")


def cli(workdir: Path, args: tuple[str, ...], *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", "--config", TINY, "--workdir", str(workdir), *args, *extra]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out["JAX_PLATFORMS"] = "cpu"
    return out


def start(workdir: Path, args: tuple[str, ...]) -> subprocess.Popen:
    """The run, its stderr going to `<workdir>.stderr` (readable while it runs) and stdout to a pipe."""
    err = open(f"{workdir}.stderr", "w")  # noqa: SIM115 (the child holds it; closed in finish)
    proc = subprocess.Popen(cli(workdir, args), env=env(), stdout=subprocess.PIPE, stderr=err, text=True)
    proc.err_file = err  # type: ignore[attr-defined]
    proc.err_path = Path(err.name)  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    out, _ = proc.communicate(timeout=timeout)
    proc.err_file.close()  # type: ignore[attr-defined]
    return out, proc.err_path.read_text()  # type: ignore[attr-defined]


def compiling(proc: subprocess.Popen):
    """The run printed its data line: the next thing it does is compile the first step."""
    return lambda: "data: " in proc.err_path.read_text()  # type: ignore[attr-defined]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def clean(err: str) -> None:
    """No traceback or library noise on stderr: read to the end of the process, every line is one of the
    command's own, so nothing (a thread's traceback, a warning, garbage collected at exit) follows the last."""
    for noise in NOISE:
        assert noise not in err, err
    assert foreign_lines(err) == [], err


def one_line(err: str, text: str) -> str:
    """The single stderr line holding `text` (progress lines may precede it)."""
    lines = [line for line in err.splitlines() if text in line]
    assert len(lines) == 1, err
    return lines[0]


def params(workdir: Path) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(restore_run(workdir, latest_step(workdir)).params)]


def assert_same_run(workdir: Path, whole: Path) -> None:
    """Bitwise the parameters of the uninterrupted run; every (split, step) of its metrics, each once."""
    for x, y in zip(params(workdir), params(whole), strict=True):
        np.testing.assert_array_equal(x, y)
    steps = [(r["split"], r["step"]) for r in read_jsonl(workdir / "metrics.jsonl")]
    assert len(steps) == len(set(steps))
    assert sorted(steps) == sorted((r["split"], r["step"]) for r in read_jsonl(whole / "metrics.jsonl"))


def resume(workdir: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    done = subprocess.run(cli(workdir, args), env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    clean(done.stderr)
    return done


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("whole") / "run"
    subprocess.run(cli(workdir, ARGS), env=env(), check=True, capture_output=True)
    return workdir


@pytest.fixture(scope="module")
def whole_wide(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("whole_wide") / "run"
    subprocess.run(cli(workdir, WIDE), env=env(), check=True, capture_output=True)
    return workdir


def train_steps_at_least(workdir: Path, step: int):
    return lambda: any(r["split"] == "train" and r["step"] >= step for r in read_jsonl(workdir / "metrics.jsonl"))


def saving(workdir: Path, step: int):
    ckpts = workdir / "checkpoints"
    return lambda: ckpts.is_dir() and any(p.name.startswith(f"{step}.orbax-checkpoint-tmp") for p in ckpts.iterdir())


# --- kill -9 and two writers -----------------------------------------------------------------------


@pytest.mark.slow
def test_kill_9_mid_save_resumes_from_the_previous_checkpoint(whole_wide, tmp_path):
    proc = start(tmp_path, WIDE)
    wait_for(saving(tmp_path, 20), proc)
    proc.kill()
    proc.wait()
    assert latest_step(tmp_path) == 10  # the half-written 20 is never listed
    done = resume(tmp_path, WIDE)
    assert "resuming from step 10" in done.stderr
    assert not any("orbax-checkpoint-tmp" in p.name for p in (tmp_path / "checkpoints").iterdir())
    assert_same_run(tmp_path, whole_wide)


@pytest.mark.slow
def test_a_second_run_on_a_busy_workdir_is_refused_and_readers_still_work(tmp_path):
    args = (*ARGS, "train.steps=400", "checkpoint.every=10")
    first = start(tmp_path, args)
    wait_for(lambda: latest_step(tmp_path) is not None, first)
    second = subprocess.run(cli(tmp_path, args), env=env(), capture_output=True, text=True)
    assert second.returncode == 2
    clean(second.stderr)
    assert second.stderr.count("\n") == 1
    assert f"is in use by process {first.pid}" in second.stderr and "use another --workdir" in second.stderr
    # Read-only commands take no lock: they work while the run trains.
    evaluated = subprocess.run([sys.executable, "-m", "train", "evaluate", "--workdir", str(tmp_path),
                                "--split", "validation"], env=env(), capture_output=True, text=True)
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith("validation: accuracy ")
    first.send_signal(signal.SIGINT)
    _, err = finish(first)
    assert first.returncode == 0, err
    clean(err)
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, len(steps) + 1))  # every step once: the refused run wrote nothing


# --- a damaged checkpoint ----------------------------------------------------------------------------


def damage(workdir: Path, step: int) -> Path:
    """Truncate the largest array file of checkpoint `step`'s parameters, as a full disk leaves it."""
    files = list((workdir / "checkpoints" / str(step) / "params" / "ocdbt.process_0" / "d").iterdir())
    target = max(files, key=lambda p: p.stat().st_size)
    os.truncate(target, 20)
    return target


def test_evaluate_and_predict_on_a_damaged_checkpoint(reference_run, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    damage(workdir, 10)
    assert main(["evaluate", "--workdir", str(workdir), "--split", "validation"]) == 0
    captured = capsys.readouterr()
    clean(captured.err)
    note = one_line(captured.err, "checkpoint 10 is damaged (params/")
    assert note.endswith("using checkpoint 5 (the next training run on this workdir moves the damaged one aside)")
    assert captured.out.endswith("checkpoint 5)\n")
    assert committed_steps(workdir / "checkpoints") == [5, 10]  # read-only: nothing moved

    assert main(["predict", "--workdir", str(workdir), "--step", "10", "1 2 3"]) == 2
    err = capsys.readouterr().err
    clean(err)
    assert err.count("\n") == 1 and "checkpoint 10" in err and "is damaged" in err and "pass --step 5" in err

    assert main(["evaluate", "--workdir", str(workdir), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no checkpoint 7" in err and "it has checkpoints 5, 10" in err


@pytest.mark.slow
def test_diagnose_on_a_damaged_checkpoint_reads_the_newest_good_one(reference_run, tmp_path, capsys):
    """diagnose reads as evaluate does: the note, then the report of checkpoint 5 (exit 0, or 1 for a failed
    check), nothing moved. Slow: the whole debugging path runs (evaluate/predict above stay in the default suite)."""
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    damage(workdir, 10)
    assert main(["diagnose", "--workdir", str(workdir), "--random", "--out", str(tmp_path / "diagnosis")]) in (0, 1)
    captured = capsys.readouterr()
    clean(captured.err)
    assert one_line(captured.err, "checkpoint 10 is damaged (params/").endswith("using checkpoint 5 (the next "
                                                                               "training run on this workdir "
                                                                               "moves the damaged one aside)")
    assert (tmp_path / "diagnosis" / "report.md").is_file()
    assert committed_steps(workdir / "checkpoints") == [5, 10]


@pytest.mark.slow
def test_training_moves_a_damaged_checkpoint_aside_and_continues_exactly(reference_run, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(reference_run[0], workdir)
    before = sorted(p.relative_to(workdir) for p in (workdir / "checkpoints/5").rglob("*"))
    damage(workdir, 10)
    assert main(["--config", TINY, "--workdir", str(workdir), *STANDARD]) == 0
    err = capsys.readouterr().err
    clean(err)
    note = one_line(err, "checkpoint 10 is damaged")
    assert "moved to checkpoints.damaged/10-" in note and note.endswith("resuming from 5")
    (moved,) = (workdir / "checkpoints.damaged").iterdir()
    assert "Traceback" in (moved / DAMAGE_NOTE).read_text()
    assert sorted(p.relative_to(workdir) for p in (workdir / "checkpoints/5").rglob("*")) == before
    assert_same_run(workdir, reference_run[0])


@pytest.mark.slow
@pytest.mark.parametrize("kind", DAMAGE_KINDS)
def test_a_damaged_checkpoint_of_every_kind_in_real_processes_ends_with_their_own_lines(whole, tmp_path, kind):
    """The real commands, read to the end of each process: evaluate names the damage and uses the previous
    checkpoint, verify reports it, and the rerun moves it aside and continues exactly."""
    workdir = tmp_path / "run"
    shutil.copytree(whole, workdir)
    damage_kind(workdir / "checkpoints" / "20", kind)
    evaluated = subprocess.run([sys.executable, "-m", "train", "evaluate", "--workdir", str(workdir), "--split",
                                "validation"], env=env(), capture_output=True, text=True)
    assert evaluated.returncode == 0, evaluated.stderr
    clean(evaluated.stderr)
    assert one_line(evaluated.stderr, "checkpoint 20 is damaged").endswith("using checkpoint 15 (the next training "
                                                                          "run on this workdir moves the damaged one "
                                                                          "aside)")
    verified = subprocess.run([sys.executable, "-m", "train", "verify", "--workdir", str(workdir)], env=env(),
                              capture_output=True, text=True)
    assert verified.returncode == 1 and verified.stderr == "", verified.stderr
    assert "checkpoint 20: damaged (params" in verified.stdout
    done = resume(workdir, ARGS)
    assert one_line(done.stderr, "checkpoint 20 is damaged").endswith("resuming from 15")
    assert_same_run(workdir, whole)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["config", "data"])
def test_bad_input_in_a_real_process_is_its_one_line_to_the_end(tmp_path, case):
    if case == "config":
        bad = tmp_path / "bad.yaml"
        bad.write_text("model:\n  num_layers: -1\n")
        command = [sys.executable, "-m", "train", "--config", str(bad), "--workdir", str(tmp_path / "w")]
    else:
        data = tmp_path / "reviews.csv"
        data.write_bytes(b"text,label\n\xff\xfe broken,1\n")
        command = cli(tmp_path / "w", ARGS, "data.source=file", f"data.path={data}")
    done = subprocess.run(command, env=env(), capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    clean(done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: ")
    assert not (tmp_path / "w" / "checkpoints").exists()


@pytest.mark.slow
def test_every_command_in_a_real_process_ends_with_its_own_last_line(whole, tmp_path):
    """Each read-only command on a finished run, read to the end of its process: exit 0 and nothing on
    stderr that is not the command's own (no thread, event loop or garbage collector printing at exit)."""
    commands = {
        "evaluate": ["evaluate", "--workdir", str(whole), "--split", "test"],
        "predict": ["predict", "--workdir", str(whole), "1 2 3 4", "5 6 7"],
        "verify": ["verify", "--workdir", str(whole)],
        "schema": ["schema"],
        "diagnose": ["diagnose", "--workdir", str(whole), "--random", "--out", str(tmp_path / "diagnosis")],
    }
    for name, args in commands.items():
        done = subprocess.run([sys.executable, "-m", "train", *args], env=env(), capture_output=True, text=True)
        assert done.returncode in ((0, 1) if name == "diagnose" else (0,)), (name, done.stderr)
        clean(done.stderr)
        assert done.stdout.strip(), name


# --- interrupts -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_at_start_up_is_one_line_and_writes_nothing(tmp_path):
    proc = start(tmp_path / "w", ARGS)
    time.sleep(0.5)  # inside the imports
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc, 120)
    assert proc.returncode == 130
    clean(err)
    assert err.count("\n") == 1 and err.startswith("interrupted during start-up")
    assert not (tmp_path / "w" / "checkpoints").exists()


def start_until(workdir: Path, when: str) -> subprocess.Popen:
    """A run of ARGS, once it is compiling (`when="compile"`) or has logged 7 training steps (`"step"`)."""
    proc = start(workdir, ARGS)
    wait_for(compiling(proc) if when == "compile" else train_steps_at_least(workdir, 7), proc)
    return proc


def stopped_summary(workdir: Path) -> dict:
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["preempted"] and (workdir / "curves.png").is_file()
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("when", ["compile", "step"])
def test_ctrl_c_once_saves_writes_the_summary_and_the_rerun_continues_exactly(whole, tmp_path, when):
    proc = start_until(tmp_path, when)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    clean(err)
    one_line(err, "SIGINT: stopping after this step and saving a checkpoint")
    stopped = int(out.split("stopped by signal at step ")[1].split(":")[0])
    assert latest_step(tmp_path) == stopped == stopped_summary(tmp_path)["step"]
    assert "resuming from step" in resume(tmp_path, ARGS).stderr
    assert_same_run(tmp_path, whole)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["compile", "step"])
def test_ctrl_c_twice_stops_now_and_keeps_the_last_checkpoint(whole, tmp_path, when):
    proc = start_until(tmp_path, when)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = finish(proc)
    assert proc.returncode in (130, 0), err  # 0: the first stop had finished before the second arrived
    clean(err)
    if proc.returncode == 130:
        one_line(err, "interrupted during")
    resume(tmp_path, ARGS)
    assert_same_run(tmp_path, whole)


@pytest.mark.slow
@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_during_a_save_finishes_it(whole_wide, tmp_path, times):
    proc = start(tmp_path, WIDE)
    wait_for(saving(tmp_path, 10), proc)
    for _ in range(times):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, err = finish(proc)
    assert proc.returncode in ((0,) if times == 1 else (0, 130)), err  # 0: the stop finished before the 2nd
    clean(err)
    assert latest_step(tmp_path) is not None and latest_step(tmp_path) >= 10  # the save in progress completed
    params(tmp_path)  # and restores
    resume(tmp_path, WIDE)
    assert_same_run(tmp_path, whole_wide)


# --- disk full ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_disk_full_during_a_save_is_one_line_and_the_rerun_continues(whole, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    # Room for the run's files and one checkpoint (~0.4 MB), not two.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mount)], check=True)
    try:
        workdir = mount / "run"
        failed = subprocess.run(cli(workdir, ARGS), env=env(), capture_output=True, text=True)
        assert failed.returncode == 2, failed.stderr
        clean(failed.stderr)
        line = one_line(failed.stderr, "error: disk full while")
        assert "free space and rerun the same command to continue" in line  # a save or a metrics write
        assert committed_steps(workdir / "checkpoints") == [5]
        params(workdir)  # the older checkpoint is intact
        subprocess.run(["mount", "-o", "remount,size=16m", str(mount)], check=True)
        assert "resuming from step 5" in resume(workdir, ARGS).stderr
        assert_same_run(workdir, whole)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# --- non-finite values at padded positions -----------------------------------------------------------


class PaddedWith(PassThrough):
    """Every training batch padded with 16 more positions holding `pad_id`."""

    def __init__(self, source, pad_id: int):
        super().__init__(source)
        self.pad_id = pad_id

    def batch(self, step: int):
        out = dict(self.source.batch(step))
        n = out["tokens"].shape[0]
        out["tokens"] = np.concatenate([out["tokens"], np.full((n, 16), self.pad_id, out["tokens"].dtype)], 1)
        out["valid_tokens"] = np.concatenate([out["valid_tokens"], np.zeros((n, 16), bool)], 1)
        return out


@pytest.mark.slow
def test_out_of_range_ids_at_padded_positions_change_nothing(tiny, tmp_path):
    cfg = tiny("model.max_len=32")
    clean_run = run.train(cfg, tmp_path / "clean", batches=lambda s: PaddedWith(s, 0))
    poisoned = run.train(cfg, tmp_path / "poisoned", batches=lambda s: PaddedWith(s, 10_000))  # NaN embeddings
    assert poisoned["test_accuracy"] == clean_run["test_accuracy"]
    nonfinite = [r["nonfinite_total"] for r in read_jsonl(tmp_path / "poisoned/metrics.jsonl") if r["split"] == "train"]
    assert max(nonfinite) == 0  # no step was skipped: the gradients stayed finite
    assert_same_run(tmp_path / "poisoned", tmp_path / "clean")
