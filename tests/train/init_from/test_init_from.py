"""model.init_from: a run's encoder starts from another run's checkpoint (or a transformers checkpoint,
slow tests at the end); the head is fresh, the shape comes from the checkpoint, bad sources are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from tests.conftest import SYMBOL_TEXTS as SYMBOLS
from tests.conftest import TINY, random_bert_dir, tiny_config
from train import run
from train.__main__ import main
from train.checkpoints.restore import restore_run
from train.config import ConfigError
from train.init_from import INIT_DIR

# The tests here that do not read the reference run share a worker with the other files that build
# transformers models (tests/conftest.py).
XDIST_GROUP = "transformers"


def leaves(tree: Any) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def source_and_fresh(reference_run, tmp_path_factory) -> tuple[Any, np.ndarray]:
    """The reference run's step-10 parameters and the head kernel of a fresh run with seed 7, made once for
    the three layouts below."""
    fresh = run.plan_run(tiny_config("train.seed=7"), tmp_path_factory.mktemp("fresh")).initial_state()
    return jax.device_get(restore_run(reference_run[0], 10).params), np.asarray(fresh.params["head"]["kernel"])


@pytest.mark.parametrize("strategy", ["single", pytest.param("pmap", marks=pytest.mark.slow), "sharded"])
def test_fresh_run_starts_from_the_source_encoder_with_a_fresh_head(reference_run, source_and_fresh, tmp_path,
                                                                    strategy):
    source, _ = reference_run
    src_params, fresh_head = source_and_fresh
    plan = run.plan_run(tiny_config(f"model.init_from={source}@10", "train.seed=7",
                                    f"parallel.strategy={strategy}", "parallel.mesh.fsdp=2"), tmp_path / "new")
    state = plan.runner.unreplicate(plan.initial_state())
    if strategy == "sharded":  # placed by the runner: the fsdp axis splits the embedding
        assert not state.params["encoder"]["embedding"].sharding.is_fully_replicated
    state = jax.device_get(state)
    new, old = leaves(state.params["encoder"]), leaves(src_params["encoder"])
    assert new.keys() == old.keys()
    for name in old:
        np.testing.assert_array_equal(new[name], old[name], err_msg=name)
    np.testing.assert_array_equal(state.params["head"]["kernel"], fresh_head)
    assert not np.array_equal(state.params["head"]["kernel"], src_params["head"]["kernel"])


@pytest.mark.slow  # a whole CLI run; the in-process init_from tests stay fast
def test_cli_fine_tunes_records_the_source_and_resume_keeps_its_checkpoint(reference_run, tmp_path):
    source, _ = reference_run
    work = tmp_path / "ft"
    args = ["--config", str(TINY), "--workdir", str(work), f"model.init_from={source}", "parallel.strategy=single",
            "train.progress=false", "train.steps=4", "checkpoint.every=2", "train.eval_every=2",
            "model.block.ffn_dropout=0.1"]
    assert main(args) == 0
    record = json.loads((work / "run.json").read_text())
    assert record["init_from"]["step"] == 10 and record["init_from"]["path"] == str(source.absolute())
    assert (work / INIT_DIR / "config.yaml").is_file()
    assert (work / "tokenizer" / "tokenizer_config.json").read_bytes() == \
        (source / "tokenizer" / "tokenizer_config.json").read_bytes()
    params4 = restore_run(work, 4).params
    # Resume past the end: the run's own checkpoint wins over the source's weights.
    assert main([*args[:-1], "train.steps=6"]) == 0
    plan = run.plan_run(run.config_for_workdir(None, ["train.steps=8"], work), work)
    assert plan.start_step == 6 and plan.init is not None and plan.init.encoder is None
    # The run keeps its init_from: omitted, it is the run's own; another one is refused.
    assert run.plan_run(tiny_config("train.steps=8"), work).config.model.init_from == str(source)
    with pytest.raises(ConfigError, match=r"holds a run started from model\.init_from="):
        run.plan_run(tiny_config("train.steps=8", f"model.init_from={source}@5"), work)
    params6 = restore_run(work, 6).params
    assert not np.array_equal(params6["head"]["kernel"], params4["head"]["kernel"])
    assert main(["evaluate", "--workdir", str(work)]) == 0


def test_contradicting_override_is_refused_free_ones_allowed(reference_run, tmp_path, capsys):
    source, _ = reference_run
    work = tmp_path / "bad"
    code = main(["--config", str(TINY), "--workdir", str(work), f"model.init_from={source}",
                 "model.block.model_dim=64", "parallel.strategy=single"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not work.exists()
    assert "model.block.model_dim=64" in err and "32" in err
    # In the Python API every set shape key is checked (no config file to override).
    with pytest.raises(ConfigError, match="num_layers=3"):
        run.plan_run(tiny_config(f"model.init_from={source}", "model.num_layers=3"), work)
    with pytest.raises(ConfigError, match="max_len=32 exceeds the 16 positions"):
        run.plan_run(tiny_config(f"model.init_from={source}", "model.max_len=32"), work)
    plan = run.plan_run(tiny_config(f"model.init_from={source}", "model.max_len=8", "data.max_len=8",
                                    "data.buckets=[8]", "model.block.attention.dropout=0.1"), work)
    assert plan.config.model.max_len == 8 and plan.config.model.block.attention.dropout == 0.1
    assert plan.initial_state().params["encoder"]["pos_embedding"].shape == (8, 32)


@pytest.mark.parametrize("spec", ["missing", "not_a_run", "no_checkpoint", "bad_step", "hf_missing"])
def test_bad_init_from_is_one_line_exit_2_nothing_written(reference_run, tmp_path, capsys, spec):
    source, _ = reference_run
    empty = tmp_path / "empty"
    empty.mkdir()
    bare = tmp_path / "bare"  # a run's files but no checkpoint
    bare.mkdir()
    shutil.copy(source / "config.yaml", bare / "config.yaml")
    shutil.copytree(source / "tokenizer", bare / "tokenizer")
    value = {"missing": str(tmp_path / "nope"), "not_a_run": str(empty), "no_checkpoint": str(bare),
             "bad_step": f"{source}@7", "hf_missing": f"hf:{empty}"}[spec]
    work = tmp_path / "work"  # an empty directory the run would have used
    work.mkdir()
    code = main(["--config", str(TINY), "--workdir", str(work), f"model.init_from={value}",
                 "parallel.strategy=single", "train.steps=20"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: model.init_from=") and "\n" not in err, err
    assert not any(work.iterdir())


def test_packing_needs_mean_pooling(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.packing"):
        run.plan_run(tiny_config("data.packing=true", "model.pooler.pooling=cls"), tmp_path / "w")


# --- hf:<dir>: small transformers checkpoints built here, with tokenizers trained on the tiny data ---------



def bert_dir(root: Path) -> Path:
    """A random 2-layer BertModel (D=32) saved with a WordPiece tokenizer.json and a license file."""
    path = random_bert_dir(root / "bert")
    (path / "LICENSE").write_text("test license\n")
    return path


def llama_dir(root: Path) -> Path:
    """A random 2-layer LlamaModel (D=32, 4 query heads over 2 kv heads) with a BPE tokenizer adding <s>."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SYMBOLS, trainers.BpeTrainer(special_tokens=["<unk>", "<s>", "</s>"],
                                                         show_progress=False))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, bos_token_id=bos, eos_token_id=2)
    path = root / "llama"
    transformers.LlamaModel(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_hf_bert_plan_loads_its_encoder_tokenizer_and_pooling(tmp_path):
    pytest.importorskip("transformers")
    from jaxblock.interop.hf import from_hf

    path = bert_dir(tmp_path)
    work = tmp_path / "work"
    config = run.config_for_workdir(str(TINY), [f"model.init_from=hf:{path}", "parallel.strategy=single"], work)
    plan = run.plan_run(config, work)
    model = plan.config.model
    assert (model.block.model_dim, model.num_layers, model.max_len, model.pooler.pooling) == (32, 2, 16, "cls")
    assert model.block.norm == "post" and model.embedding.norm and model.block.residual_dropout == 0.1  # BERT's own
    tok = plan.dataset.tokenizer
    ids = tok.encode("3 4")
    assert tok.kind == "pretrained" and tok.pad_id == 0 and len(ids) == 4
    cls_id, sep_id = tok._tok.token_to_id("[CLS]"), tok._tok.token_to_id("[SEP]")
    assert (ids[0], ids[-1]) == (cls_id, sep_id)
    # 16 symbols + [CLS] + [SEP] do not fit max_len 16: the row is cut inside the text and still ends in [SEP].
    assert plan.dataset.truncated["train"] > 0
    assert all(len(r) <= 16 and r[0] == cls_id and r[-1] == sep_id for r in plan.dataset.train.tokens)
    _, want = from_hf(path, max_len=16)
    got = leaves(plan.initial_state().params["encoder"])
    want_leaves = leaves(want["params"])
    assert got.keys() == want_leaves.keys()
    for name, value in want_leaves.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    with pytest.raises(ConfigError, match=r"model\.num_layers=3 contradicts .* which has 2"):
        run.plan_run(run.config_for_workdir(str(TINY), [f"model.init_from=hf:{path}", "model.num_layers=3"],
                                            work), work)
    assert not work.exists()


def _cli(*args: str) -> Any:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "train", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_cli_fine_tunes_a_transformers_checkpoint_then_evaluates_and_predicts(tmp_path, family):
    pytest.importorskip("transformers")
    path = (bert_dir if family == "bert" else llama_dir)(tmp_path)
    work = tmp_path / "run"
    done = _cli("--config", str(TINY), "--workdir", str(work), f"model.init_from=hf:{path}",
                "train.progress=false", "train.steps=40", "checkpoint.every=20", "train.eval_every=20")
    assert done.returncode == 0, done.stderr
    assert "done: 40 steps" in done.stdout
    assert (work / INIT_DIR / "config.json").read_bytes() == (path / "config.json").read_bytes()
    assert (work / INIT_DIR / "LICENSE").is_file() == (family == "bert")
    record = json.loads((work / "run.json").read_text())["init_from"]
    assert record["kind"] == "hf" and record["model_type"] == family
    saved = json.loads((work / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["kind"] == "pretrained"
    evaluated = _cli("evaluate", "--workdir", str(work))
    assert evaluated.returncode == 0 and "test: accuracy" in evaluated.stdout, evaluated.stderr
    predicted = _cli("predict", "--workdir", str(work), "3 4 5 3", "1 2")
    assert predicted.returncode == 0, predicted.stderr
    header, *rows = predicted.stdout.strip().splitlines()
    assert header.split("\t") == ["label", "probability", "truncated", "text"]
    assert [row.split("\t")[-1] for row in rows] == ["3 4 5 3", "1 2"]
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if m.get("split") == "train" and "loss" in m]
    assert losses and all(np.isfinite(losses))
