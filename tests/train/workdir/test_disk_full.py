"""A full disk while writing run files: one line naming the file and the fix, nothing half-written.

The disk is filled with a file-size limit (RLIMIT_FSIZE, lowered around one write and restored at once):
a write past it writes what fits and then fails with EFBIG, exactly like ENOSPC on a full disk (Python
ignores SIGXFSZ, so the process is not killed). No root or special filesystem needed.
"""

import contextlib
import json
import resource

import pytest

from train.errors import DiskFullError
from train.workdir.files import atomic_write
from train.workdir.metrics_log import JSONL_FILE, MetricsLog, read_jsonl


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _lines(path):
    return path.read_bytes().decode().splitlines(keepends=True)


def test_metrics_write_on_a_full_disk_leaves_no_partial_line_and_a_rerun_records_each_step_once(tmp_path):
    log = MetricsLog(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        log.write("train", step, {"loss": 0.5, "accuracy": 0.75})
    path = tmp_path / JSONL_FILE
    before = path.read_bytes()
    with file_size_limit(len(before) + 10), pytest.raises(DiskFullError) as full:  # room for part of a line
        log.write("train", 4, {"loss": 0.25, "accuracy": 0.875})
    message = str(full.value)
    assert "\n" not in message
    assert message.startswith(f"disk full while writing {JSONL_FILE} in {tmp_path}")
    assert message.endswith("free space and rerun the same command to continue")
    assert path.read_bytes() == before  # cut back to the last complete line
    log.write("train", 4, {"loss": 0.25, "accuracy": 0.875})  # space again: the same step is written
    log.close()
    assert all(line.endswith("\n") for line in _lines(path))
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]
    # A rerun resuming from a checkpoint at step 3 keeps each step once and recomputes step 4.
    rerun = MetricsLog(tmp_path, resume_step=3)
    rerun.write("train", 3, {"loss": 9.0, "accuracy": 0.0})  # already recorded: ignored
    rerun.write("train", 4, {"loss": 0.25, "accuracy": 0.875})
    rerun.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]
    assert read_jsonl(path)[2]["loss"] == 0.5


def test_rerun_on_a_full_disk_keeps_the_metrics_file(tmp_path):
    log = MetricsLog(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        log.write("train", step, {"loss": 0.5})
    log.close()
    path = tmp_path / JSONL_FILE
    before = path.read_bytes()
    with file_size_limit(20), pytest.raises(DiskFullError, match=f"disk full while writing {JSONL_FILE}"):
        MetricsLog(tmp_path, resume_step=2)  # rewriting the kept records needs room
    assert path.read_bytes() == before
    assert not path.with_name(JSONL_FILE + ".tmp").exists()


def test_atomic_write_on_a_full_disk_keeps_the_previous_version(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write(path, json.dumps({"step": 1}))
    with file_size_limit(8), pytest.raises(DiskFullError, match=r"disk full while writing summary\.json"):
        atomic_write(path, json.dumps({"step": 2, "padding": "x" * 100}))
    assert json.loads(path.read_text()) == {"step": 1}
    assert not (tmp_path / "summary.json.tmp").exists()


def test_other_write_errors_are_not_reported_as_a_full_disk(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "summary.json", "{}")


def test_a_checkpoint_save_that_ran_out_of_space_is_one_line():
    from train.checkpoints.repair import save_failed_for_space

    # The error Orbax's async save raised from wait_until_finished on a full 700 KiB tmpfs (abridged).
    seen = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "opt_state.inner_state.1.0.mu.encoder.stack.layers_0.ffn.linear2.bias/0" '
        'in OCDBT database at local file "/w/checkpoints/20.orbax-checkpoint-tmp/train.orbax-checkpoint-tmp/'
        'ocdbt.process_0/": Failed writing: "/w/.../d/f1c6": Failed to write 44616 bytes to file 11: No space left '
        "on device [os_error_code='28']")
    full = save_failed_for_space(seen, "/w/checkpoints", 20)
    assert full is not None and "\n" not in str(full)
    assert str(full) == ("disk full while saving checkpoint 20 in /w/checkpoints: free space and rerun the same "
                         "command to continue from the newest complete checkpoint")
    assert save_failed_for_space(ValueError("RESOURCE_EXHAUSTED: out of memory"), "/w", 20) is None
    assert save_failed_for_space(OSError(28, "No space left on device"), "/w", None) is not None
