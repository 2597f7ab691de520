"""The family registry, the newer families (XLM-RoBERTa, CamemBERT, ELECTRA, ModernBERT) and reading a
checkpoint without torch or transformers. Tiny random models from jaxblock.interop.hf.measure (D=64, 2 layers,
as the first six families'); the torch-free read path runs in a subprocess (slow)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxblock import Classifier, Encoder, EncoderConfig  # noqa: E402
from jaxblock.interop import hf  # noqa: E402
from jaxblock.interop.hf.common import Mapping, linear, norm  # noqa: E402
from jaxblock.interop.hf.measure import FAMILIES, PAD, tiny_batch, tiny_model  # noqa: E402

# Shares one xdist worker with the other files that build transformers models (tests/conftest.py), which
# import transformers in the tests, never at collection: the other worker never loads it.
XDIST_GROUP = "transformers"

NEW = ("xlm-roberta", "camembert", "electra", "modernbert")
# Keys some families read from config.json files older than transformers 5 (not fields of its config class).
_LEGACY = {"global_attn_every_n_layers", "global_rope_theta", "local_rope_theta"}


def _hidden(model: Any, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(valid.astype(np.int64)))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().numpy()


def _ours(cfg: EncoderConfig, variables: Any, tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    model = Classifier(cfg) if "encoder" in variables["params"] else Encoder(cfg)
    return np.asarray(model.apply(variables, jnp.asarray(tokens), jnp.asarray(valid)))


def _same_state_dict(got: Any, want: Any) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- the registry -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_defaults_are_its_transformers_config_class_defaults(family: str) -> None:
    import transformers

    fam = hf.family(family)
    cls = getattr(transformers, fam.hf_class + "Config")
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in fam.defaults.items():
        if key in _LEGACY:
            continue
        assert key in fields, f"{family}: {key} is not a field of {cls.__name__}"
        assert fields[key] == value, f"{family}: {key} defaults to {fields[key]!r} in transformers, {value!r} here"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_minimal_config_json_reads_as_transformers_reads_it(family: str, tmp_path: Path) -> None:
    """Hub config.json files often hold only what differs from the defaults: drop every key equal to the
    config class's default and read the directory as transformers would fill it in."""
    import transformers

    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    cls = getattr(transformers, hf.family(family).hf_class + "Config")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    raw = json.loads((tmp_path / "config.json").read_text())
    minimal = {k: v for k, v in raw.items() if k == "model_type" or k not in defaults or defaults[k] != v}
    assert len(minimal) < len(raw)
    (tmp_path / "config.json").write_text(json.dumps(minimal))
    theirs = transformers.AutoModel.from_pretrained(tmp_path)  # transformers fills in its defaults
    assert hf.from_hf(tmp_path)[0] == hf.from_hf(theirs)[0]


def test_an_old_modernbert_config_reads_its_rope_thetas_and_layer_pattern(tmp_path: Path) -> None:
    """Before transformers 5: global/local_rope_theta and global_attn_every_n_layers, no layer_types."""
    model = tiny_model("modernbert")
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw |= {"global_rope_theta": 1000.0, "local_rope_theta": 50.0, "global_attn_every_n_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, variables = hf.from_hf(tmp_path)
    assert cfg.layers.window == (None, 2) and cfg.layers.rope_base == (1000.0, 50.0)
    tokens, valid, _ = tiny_batch()
    np.testing.assert_allclose(_ours(cfg, variables, tokens, valid)[valid], _hidden(model, tokens, valid)[valid],
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["mistral", "xlm-roberta", "camembert", "electra", "modernbert"])
def test_from_hf_and_load_pretrained_report_the_real_family(family: str, tmp_path: Path) -> None:
    tiny_model(family).save_pretrained(tmp_path)
    assert hf.from_hf(tmp_path).family == family
    assert hf.load_pretrained(tmp_path).family == family
    _, params, _, _ = hf.load_pretrained(tmp_path)  # still unpacks as four
    assert "stack" in params


def test_unknown_model_types_and_taken_names_are_refused_in_one_line() -> None:
    with pytest.raises(hf.UnsupportedConfigError, match=r"^model_type='gpt2': not converted: jaxblock reads "):
        hf.family("gpt2")
    with pytest.raises(ValueError, match="'bert' is already registered"):
        hf.register(dataclasses.replace(hf.family("bert"), name="bert2"))


# --- a family added from this file alone ----------------------------------------------------------

_TOY_DEFAULTS = {"width": 16, "depth": 2, "heads": 2, "inner": 24, "vocab": 20, "eps": 1e-5}


def _toy_fields(c: hf.HFConfig, max_len: int | None) -> dict[str, Any]:
    return dict(num_layers=c.depth, vocab_size=c.vocab, max_len=max_len or 16, embedding=dict(positions="none"),
                block=dict(model_dim=c.width, num_heads=c.heads, ffn_dim=c.inner, norm="pre", norm_type="rmsnorm",
                           norm_eps=c.eps, activation="swiglu", use_bias=False, attention=dict(rope=True)))


def _toy_map(cfg: EncoderConfig) -> list[Mapping]:
    rows = [Mapping("tok.weight", ("embedding",), "same"), *norm("out_norm", ("stack", "final_norm"), bias=False)]
    for i in range(cfg.num_layers):
        ours = ("stack", f"layers_{i}")
        for j, proj in enumerate(("query", "key", "value")):
            rows += linear(f"blk{i}.qkv", (*ours, "self_attn", proj), bias=False, part=(j, 3))
        rows += linear(f"blk{i}.o", (*ours, "self_attn", "out"), bias=False, n_in=2)
        rows += linear(f"blk{i}.up", (*ours, "ffn", "linear1"), bias=False)
        rows += linear(f"blk{i}.gate", (*ours, "ffn", "gate"), bias=False)
        rows += linear(f"blk{i}.down", (*ours, "ffn", "linear2"), bias=False)
        rows += norm(f"blk{i}.n1", (*ours, "attn_norm"), bias=False)
        rows += norm(f"blk{i}.n2", (*ours, "ffn_norm"), bias=False)
    return rows


def test_a_toy_family_registered_from_a_test_file_converts(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    toy = hf.Family(name="toy", model_types=("toy-encoder",), hf_class="Toy", prefix="toy", defaults=_TOY_DEFAULTS,
                    encoder_fields=_toy_fields, encoder_map=_toy_map, head_fields=lambda c: {"pooling": "mean"},
                    head_map=lambda cfg: [], hf_config=lambda cfg, classifier: {})
    hf.register(toy)
    try:
        cfg = EncoderConfig.model_validate(_toy_fields(toy.config({"depth": 3}), None))
        tokens, valid, _ = tiny_batch()
        tokens = tokens % cfg.vocab_size
        # Random values of the init's shapes (an eager init compiles every operation): norms off 1.
        shapes = nn.unbox(jax.eval_shape(Encoder(cfg).init, jax.random.key(1), jnp.asarray(tokens),
                                         jnp.asarray(valid)))
        rng = np.random.default_rng(1)
        variables = {"params": jax.tree.map(lambda a: (1.0 + 0.2 * rng.standard_normal(a.shape)).astype(a.dtype)
                                            if len(a.shape) == 1 else (0.2 * rng.standard_normal(a.shape))
                                            .astype(a.dtype), shapes["params"])}
        weights = hf.state_dict(cfg, variables, family="toy")  # our params under the toy's names
        assert weights["blk0.qkv.weight"].shape == (3 * 16, 16)  # fused q/k/v rows, as the toy stores them
        save_file(weights, str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy-encoder", "depth": 3}))
        converted = hf.from_hf(tmp_path)
        assert converted.family == "toy" and converted[0] == cfg
        jax.tree.map(np.testing.assert_array_equal, converted[1], variables)
        np.testing.assert_array_equal(_ours(cfg, converted[1], tokens, valid), _ours(cfg, variables, tokens, valid))
    finally:
        hf.unregister("toy")
    with pytest.raises(hf.UnsupportedConfigError, match="model_type='toy-encoder'"):
        hf.from_hf(tmp_path)


# --- the newer families ---------------------------------------------------------------------------

_SLOW = pytest.mark.slow
# Forward per layer and every parameter's gradient; ModernBERT (base and head) and ELECTRA's base in the
# default suite, the RoBERTa renamings (RoBERTa's code, checked in tests/jaxblock/interop/test_hf.py) with -m slow.
_CASES = [("modernbert", False), ("modernbert", True), ("electra", False),
          pytest.param("electra", True, marks=_SLOW), pytest.param("xlm-roberta", False, marks=_SLOW),
          pytest.param("xlm-roberta", True, marks=_SLOW), pytest.param("camembert", False, marks=_SLOW),
          pytest.param("camembert", True, marks=_SLOW)]


@pytest.mark.parametrize(("family", "head"), _CASES)
def test_new_families_match_transformers_forward_and_gradients(family: str, head: bool) -> None:
    model = tiny_model(family, head)
    tokens, valid, types = tiny_batch()
    report = hf.compare(model, tokens, valid, token_type_ids=types)
    assert report.ok, str(report)
    assert sum(c.kind == "grad" for c in report.checks) == len(model.state_dict())  # every parameter


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW)
def test_new_families_in_bfloat16_within_the_documented_tolerance(family: str) -> None:
    tokens, valid, types = tiny_batch()
    report = hf.compare(tiny_model(family), tokens, valid, token_type_ids=types, dtype="bfloat16")
    assert report.ok, str(report)


def test_electra_projects_narrow_embeddings() -> None:
    model = tiny_model("electra")
    assert model.embeddings_project.weight.shape == (64, 32)
    cfg, variables = hf.from_hf(model)
    assert cfg.embedding.dim == 32 and variables["params"]["embedding"].shape == (40, 32)
    assert variables["params"]["embed_proj"]["kernel"].shape == (32, 64)


@pytest.mark.parametrize(("pooling", "bias"), [("mean", True), ("cls", False)])
def test_modernbert_heads_pool_as_configured_and_round_trip(pooling: str, bias: bool) -> None:
    model = tiny_model("modernbert", head=True, classifier_pooling=pooling, classifier_bias=bias)
    cfg, variables = hf.from_hf(model)
    assert (cfg.pooler.pooling, cfg.pooler.dense, cfg.pooler.norm, cfg.pooler.bias) == (pooling, True, True, bias)
    tokens, valid, _ = tiny_batch(1)
    np.testing.assert_allclose(_ours(cfg, variables, tokens, valid), _hidden(model, tokens, valid), atol=2e-5, rtol=0)
    _same_state_dict(hf.to_hf(cfg, variables, pad_token_id=PAD), model)  # guessed as ModernBERT


def test_modernbert_local_windows_and_rope_bases_are_what_transformers_computes() -> None:
    """Layer 1 is local (keys within +-2, RoPE base 50), layer 0 global (base 1000); layer 0 has no attention
    norm. Without any one of these the output leaves transformers' by far more than the tolerance."""
    model = tiny_model("modernbert")
    with torch.no_grad():  # sharper attention (random q/k are small), so positions and windows weigh more
        for layer in model.layers:
            layer.attn.Wqkv.weight.mul_(8.0)
    cfg, variables = hf.from_hf(model)
    assert (cfg.layers.window, cfg.layers.rope_base, cfg.layers.attn_norm) == ((None, 2), (1000.0, 50.0),
                                                                             (False, True))
    tokens, valid, _ = tiny_batch()
    theirs = _hidden(model, tokens, valid)[valid]
    np.testing.assert_allclose(_ours(cfg, variables, tokens, valid)[valid], theirs, atol=2e-5, rtol=0)
    for name in ("window", "rope_base", "attn_norm"):
        off = _ours(cfg.model_copy(update={"layers": cfg.layers.model_copy(update={name: None})}), variables, tokens,
                    valid)[valid]
        assert np.abs(off - theirs).max() > 1e-3, name
    scanned = cfg.model_copy(update={"scan_layers": True})
    from jaxblock.model import stack_layer_params

    got = _ours(scanned, {"params": stack_layer_params(variables["params"])}, tokens, valid)[valid]
    np.testing.assert_allclose(got, theirs, atol=2e-5, rtol=0)


def _refused(fn: Any, field: str) -> None:
    with pytest.raises(hf.UnsupportedConfigError) as err:
        fn()
    assert "\n" not in str(err.value) and field in str(err.value), str(err.value)


def test_what_the_newer_families_cannot_hold_is_refused_in_one_line() -> None:
    _refused(lambda: hf.from_hf(tiny_model("modernbert", hidden_activation="silu")), "hidden_activation='silu'")
    _refused(lambda: hf.from_hf(tiny_model("modernbert", mlp_bias=True)), "mlp_bias=True")
    _refused(lambda: hf.from_hf(tiny_model("modernbert", head=True, classifier_activation="tanh")),
             "classifier_activation='tanh'")
    _refused(lambda: hf.from_hf(tiny_model("electra", hidden_act="silu")), "hidden_act='silu'")
    modern, _ = hf.from_hf(tiny_model("modernbert"))
    bert, _ = hf.from_hf(tiny_model("bert"))
    def layers(cfg: EncoderConfig, **update: Any) -> EncoderConfig:
        return cfg.model_copy(update={"layers": cfg.layers.model_copy(update=update)})

    _refused(lambda: hf.to_hf(layers(modern, window=(1, 2)), {"params": {}}), "layers.window=(1, 2)")
    _refused(lambda: hf.to_hf(layers(modern, attn_norm=None), {"params": {}}), "layers.attn_norm=None")
    _refused(lambda: hf.to_hf(layers(bert, window=(3, None)), {"params": {}}), "layers.window=(3, None)")
    wide = bert.model_copy(update={"embedding": bert.embedding.model_copy(update={"dim": 32})})
    _refused(lambda: hf.to_hf(wide, {"params": {}}, family="bert"), "embedding.dim=32")


# --- reading without torch or transformers -------------------------------------------------------


def test_bfloat16_safetensors_read_as_transformers_holds_them(tmp_path: Path) -> None:
    model = tiny_model("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, got = hf.from_hf(tmp_path)
    _, want = hf.from_hf(model)
    jax.tree.map(np.testing.assert_array_equal, got, want)


_BLOCKER = """
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""

_CHILD = """
import json, sys
import numpy as np
from jaxblock.interop import hf
from tokenizers import Tokenizer
out = {}
for name in sys.argv[2:]:
    conv = hf.from_hf(sys.argv[1] + "/" + name)
    cfg, variables = conv
    loaded = hf.load_pretrained(sys.argv[1] + "/" + name)
    flat = {"/".join(str(k.key) for k in p): np.asarray(v) for p, v in
            __import__("jax").tree_util.tree_leaves_with_path(variables)}
    np.savez(sys.argv[1] + f"/{name}.npz", **flat)
    out[name] = [conv.family, loaded.family, cfg.model_dump_json()]
tok = Tokenizer.from_file(sys.argv[1] + "/bert/tokenizer.json")
out["tokens"] = tok.encode("3 4").ids
try:
    hf.from_hf(sys.argv[1] + "/bin")
except hf.UnsupportedConfigError as err:
    out["bin"] = str(err)
from train.init_from.hf import hf_source
source = hf_source("hf:" + sys.argv[1] + "/bert")
out["source"] = [source.record["family"], source.model.pooler.pooling]
out["modules"] = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_read_path_needs_neither_torch_nor_transformers(tmp_path: Path) -> None:
    """A subprocess where importing torch or transformers fails reads bf16, sharded and plain safetensors
    directories, tokenizer.json and an init_from source, and gets exactly what the transformers path gets."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    models_ = {"bert": tiny_model("bert", head=True), "qwen2": tiny_model("qwen2"),
               "modernbert": tiny_model("modernbert"), "mistral": tiny_model("mistral").to(torch.bfloat16)}
    for name, model in models_.items():
        model.save_pretrained(tmp_path / name, **({"max_shard_size": "20KB"} if name == "qwen2" else {}))
    assert (tmp_path / "qwen2" / "model.safetensors.index.json").is_file()
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "3": 2, "4": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "bert" / "tokenizer.json"))
    (tmp_path / "bin").mkdir()
    torch.save(models_["bert"].state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "bert" / "config.json").read_text())
    code = textwrap.dedent(_BLOCKER) + textwrap.dedent(_CHILD)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), *models_], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["modules"] == []
    assert out["tokens"] == [2, 3]
    assert out["source"] == ["bert", "cls"]
    assert "torch is not installed" in out["bin"] and "\n" not in out["bin"]
    for name, model in models_.items():
        cfg, want = hf.from_hf(model)
        assert out[name][:2] == [name, name]
        assert EncoderConfig.model_validate_json(out[name][2]) == cfg
        got = np.load(tmp_path / f"{name}.npz")
        flat = {"/".join(str(k.key) for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(want)}
        assert set(got.files) == set(flat)
        for key, value in flat.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"{name} {key}")


def test_a_modernbert_checkpoint_plans_as_init_from_with_its_per_layer_stack(tmp_path: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from tests.conftest import TINY
    from train import run

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = [" ".join(str((i * 7 + j) % 16) for j in range(16)) for i in range(64)]
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"],
                                                             show_progress=False))
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    cfg = transformers.ModernBertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, local_attention=8, global_attn_every_n_layers=3, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
    path = tmp_path / "modernbert"
    transformers.ModernBertModel(cfg).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    work = tmp_path / "work"
    config = run.config_for_workdir(str(TINY), [f"model.init_from=hf:{path}", "parallel.strategy=single"], work)
    model = run.plan_run(config, work).config.model
    assert model.layers.window == (None, 4, 4) and model.layers.rope_base == (160000.0, 10000.0, 10000.0)
    assert (model.pooler.pooling, model.pooler.dense, model.pooler.norm) == ("cls", True, True)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "config.json is not JSON"),
    ('{"hidden_size": 8}', "names no model_type"),
    ('{"model_type": "t5"}', "model_type='t5': not converted"),
])
def test_a_bad_config_json_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(hf.UnsupportedConfigError) as err:
        hf.from_hf(tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)
