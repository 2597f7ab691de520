"""Test setup: 8 simulated CPU devices and strict rank promotion, before JAX is imported."""

import atexit
import gc
import importlib.metadata
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

# Bytecode is cached for the suite's own imports even where the environment sets PYTHONDONTWRITEBYTECODE
# (as container images often do): otherwise every xdist worker compiles the checkout's modules from source
# and pytest rewrites the asserts of every test module again on every run, a third of each worker's
# collection. The files go to the __pycache__ folders git ignores; an unwritable checkout only loses the
# saving.
sys.dont_write_bytecode = False

# Most of the suite's time is XLA compiling hundreds of tiny programs whose run time does not matter. For
# the jaxlib the project pins, three CPU compiler settings cut that: LLVM optimisation level 0 and the
# classic elemental emitters instead of the fusion emitters (together about half), and one LLVM module per
# program instead of a split for parallel code generation (~7% of a small compile; the suite passes either
# way; an unknown flag would abort XLA, so other jaxlib versions keep the defaults). The `python -m train`
# subprocesses of the tests drop XLA_FLAGS and compile as users do.
_FLAGS = "--xla_force_host_platform_device_count=8"
if importlib.metadata.version("jaxlib").startswith("0.10."):
    _FLAGS += (" --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
               " --xla_cpu_parallel_codegen_split_count=1")
if _FLAGS not in os.environ.get("XLA_FLAGS", ""):  # xdist workers inherit the controller's flags
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per session, shared by the xdist workers and the `python -m train`
# subprocesses (they inherit the variable): every test that rebuilds a state from the same config compiles
# the same programs (the in-memory jit cache misses on new optimizer closures), and the two workers compile
# many of the same small programs (eager operations, the shared tiny configs' steps). Every program is
# written, however fast it compiled (JAX writes only those that took a second by default, we wrote those
# over 0.5 s): a hit is one file read. The directory is this run's own, made here and removed at exit, so
# nothing another run, checkout or jaxlib compiled can be read (a JAX_COMPILATION_CACHE_DIR of the user's is used as
# given); within the run an entry is keyed by the program, the XLA flags and jaxlib, and a file the other
# worker is still writing reads as an error that JAX turns into a warning and a fresh compile.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxblock-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Lowering writes each operation's whole Python traceback into its MLIR location; the tests read op names
# (the name stack), never those frames (train/aot/programs.py turns them back on while it lowers).
os.environ.setdefault("JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS", "0")
# Only the jaxblock library is installed (pyproject): the `python -m train` subprocesses find the
# checkout's train/ and bench/ through PYTHONPATH whatever directory the suite runs from.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _checkout not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_checkout, os.environ.get("PYTHONPATH")]))

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/tiny.yaml"
# One step count and model for every tiny run: equal configs compile equal programs (the compilation
# cache hits), and a run planned from `tiny()` continues the shared reference run exactly.
STANDARD = ["parallel.strategy=single", "train.progress=false", "train.steps=10", "checkpoint.every=5",
            "checkpoint.max_to_keep=5", "train.eval_every=5", "train.log_every=1", "train.diagnostics_every=5"]


def pytest_report_header(config: pytest.Config) -> str:
    """The machine and the XLA flags the tests compile with (the compile-speed flags above)."""
    from bench.machine import cpu_model

    return f"{cpu_model()}; XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` runs the default suite on every core, but a selection with slow cases in one process:
    they time multi-process runs, kill -9 and interrupts, and each wants the whole machine."""
    return None if "not slow" in (config.option.markexpr or "") else 0


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite runs on every core (`-n auto --dist loadgroup`, pyproject.toml) with one group per file, so
    a file's first compiles happen on one worker only; one group for the tests that read the shared
    reference run, so it is built once; and one for the files that name a group of their own
    (`XDIST_GROUP`): the files that build transformers models share a worker, so only that worker
    imports transformers and its families' model code (seconds of CPU). xdist hands
    out the groups with the most tests first (its default `--loadscope-reorder`), whatever the order here."""
    for item in items:
        if "reference_run" in getattr(item, "fixturenames", ()):
            group = "reference_run"
        else:
            group = getattr(getattr(item, "module", None), "XDIST_GROUP", None) or item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


# Tracing makes objects by the million, so the collector's automatic passes ran ~9,000 times per worker
# (gen0 every 700 allocations, a full pass every ~10 younger ones since the freeze below empties the old
# generation), about 5% of a worker's time. Larger thresholds cut that by more than half;
# the garbage waits a little longer to be found, which a test worker with gigabytes to spare can afford.
gc.set_threshold(10_000, 20, 50)


@pytest.fixture(scope="module", autouse=True)
def _freeze_survivors() -> None:
    """Each test file starts with the objects that outlived the files before it moved out of the
    collector's sight (`gc.freeze`). A worker that has run many files holds hundreds of thousands of
    live objects (compiled programs, modules), and a full collection walks them all: the library's own
    `gc.collect()` calls (closing a stream, leaving a checkpoint restore) took ~0.7 s each there, about
    70 s of the suite. Frozen objects are still freed by reference counting; only cycles among them that
    die later are never reclaimed, which a test process can afford."""
    gc.collect()
    gc.freeze()


def tiny_config(*overrides: str) -> Any:
    """configs/tiny.yaml with the STANDARD overrides, then `overrides`."""
    from train.config import load_config

    return load_config(TINY, [*STANDARD, *overrides])


@pytest.fixture(scope="session")
def tiny() -> Callable[..., Any]:
    return tiny_config


@pytest.fixture(scope="session")
def tiny_plan() -> Any:
    """A planned tiny run (validated, runner and batches built); nothing is ever written for it."""
    from train import run

    return run.plan_run(tiny_config(), Path("/tmp/jaxblock-plan-only-never-written"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The one finished tiny run the tests share: 10 steps, diagnostics, validation and checkpoints at 5 and
    10, then test. Read it, never write it: copy the workdir first (shutil.copytree) to resume or break it."""
    from train import run

    workdir = tmp_path_factory.mktemp("reference") / "run"
    return workdir, run.train(tiny_config(), workdir)


# Streamed corpora (tests/train/data/test_stream.py, test_elastic_resume.py, test_stream_exit.py): numbered lines read
# through an id tokenizer, so every example names the line it came from.
STREAM_LINES = 600


def stream_tokenizer() -> Any:
    """Line i is the single word "i" -> token i + 2."""
    from train.data.tokenizer import IdTokenizer

    return IdTokenizer(STREAM_LINES)


def stream_config(root: Path, **kw: object) -> Any:
    """A small StreamConfig over `root`: rows of 8 tokens, batches of 8 rows, 4 logical shards."""
    from train.data.stream import StreamConfig

    base: dict[str, object] = dict(paths=(str(root),), row_len=8, batch_rows=8, num_shards=4, max_segments=4,
                                   window=256, block_bytes=64)
    return StreamConfig(**{**base, **kw})


def lines_in(batch: dict[str, Any]) -> list[int]:
    """The line numbers of the real tokens of a batch of the numbered corpus."""
    return [int(t) - 2 for t in batch["tokens"][batch["valid_tokens"]]]


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two files: lines "0".."299" (text) and "300".."599" (JSONL)."""
    import json

    root = tmp_path_factory.mktemp("corpus")
    (root / "a.txt").write_text("".join(f"{i}\n" for i in range(300)))
    (root / "b.jsonl").write_text("".join(json.dumps({"text": str(i), "n": i}) + "\n" for i in range(300, 600)))
    return root


def updated_state(cfg: Any, step: int = 0, seed: int = 0) -> Any:
    """The train state of `cfg` after one update with random gradients, so that the Adam moments are
    arrays worth storing (zeros or constants would compress into the metadata nodes), at `step`."""
    import jax.numpy as jnp

    from jaxblock import Classifier
    from train.loop.state import create_state, init_params

    model = Classifier(cfg.model)
    state = create_state(model, init_params(model, seed, cfg.data.buckets[-1]), cfg.optim, cfg.train.steps)
    leaves, tree = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    state = state.apply_gradients(grads=jax.tree.unflatten(tree, drawn))
    return state.replace(step=jnp.asarray(step, jnp.int32))


class PassThrough:
    """A batch source that hands everything on to `source`; tests subclass it to change some batches
    (injected into the loop the way any batch source is: `run.train(..., batches=...)`)."""

    def __init__(self, source):
        self.source = source

    def batch(self, step: int):
        return self.source.batch(step)

    def example_batch(self, step: int):
        return self.source.example_batch(step)

    def eval_batches(self, split: str):
        return self.source.eval_batches(split)

    def state(self):
        return self.source.state()

    def restore(self, state) -> None:
        self.source.restore(state)


class Faulty(PassThrough):
    """A batch source that passes batches through, with a fault at one step."""

    def __init__(self, source, step: int, fault, examples: bool = True):
        super().__init__(source)
        self.step, self.fault, self.examples = step, fault, examples

    def batch(self, step: int):
        out = self.source.batch(step)
        return self.fault(out) if step == self.step else out

    def example_batch(self, step: int):
        out = self.source.example_batch(step)
        return self.fault(out) if step == self.step and self.examples else out


def signal_at(step: int):
    """A source whose batch of `step` is requested while a real SIGTERM arrives at this process."""

    def send(batch):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while step `step + 1` is being prepared
        return batch

    return lambda source: Faulty(source, step, send, examples=False)


# Multi-process runs (tests/train/devices/test_multihost.py, tests/train/tasks/test_mlm.py).
PROCESS_TIMEOUT = 600  # seconds for a whole multi-process run on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(commands: list[list[str]], env: dict[str, str], cwd: Path) -> list[str]:
    """Start every command at once (they rendezvous), wait for all; on any failure show each output."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=PROCESS_TIMEOUT)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        tails = "\n".join(f"--- process {i} (exit {c}):\n{o[-3000:]}" for i, (c, o) in
                          enumerate(zip(codes, outputs, strict=True)))
        pytest.fail(f"multi-process run failed:\n{tails}")
    return outputs


SYMBOL_TEXTS = [" ".join(str((i * 7 + j) % 16) for j in range(16)) for i in range(64)]  # tiny.yaml's symbol texts


def random_bert_dir(path: Path) -> Path:
    """A random 2-layer BertModel (D=32, no pooler) saved with save_pretrained at `path`, with a WordPiece
    tokenizer.json trained on the symbol texts: a small transformers checkpoint directory for the tests."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(SYMBOL_TEXTS, trainers.WordPieceTrainer(
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")),
                                                   ("[CLS]", tok.token_to_id("[CLS]")))
    cfg = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=40,
                                  pad_token_id=0)
    transformers.set_seed(0)
    transformers.BertModel(cfg, add_pooling_layer=False).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path
