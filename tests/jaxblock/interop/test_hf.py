"""jaxblock.interop.hf against transformers: tiny random models saved with save_pretrained, no network."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxblock import Classifier, Encoder, EncoderConfig  # noqa: E402
from jaxblock.interop import hf  # noqa: E402
from jaxblock.interop.hf.measure import FAMILIES, PAD, VOCAB, tiny_batch, tiny_config, tiny_model  # noqa: E402

# Shares one xdist worker with the other files that build transformers models (tests/conftest.py), which
# import transformers in the tests, never at collection: the other worker never loads it.
XDIST_GROUP = "transformers"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple[Any, Path]]:
    """Every family, base and classifier, built and written with save_pretrained (safetensors)."""
    out = {}
    for family in FAMILIES:
        for head in (False, True):
            model = tiny_model(family, head)
            path = tmp_path_factory.mktemp(f"{family}{'_cls' if head else ''}")
            model.save_pretrained(path)
            out[family, head] = model, path
    return out


def _hidden(model: Any, tokens: np.ndarray, valid: np.ndarray, types: np.ndarray | None) -> np.ndarray:
    kw = {} if types is None else {"token_type_ids": torch.from_numpy(types)}
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(valid.astype(np.int64)), **kw)
    return out.last_hidden_state.numpy()


# Two families in the default suite (the directory loader is one code path); every family under -m slow.
@pytest.mark.parametrize(
    "family", [f if i < 2 else pytest.param(f, marks=pytest.mark.slow) for i, f in enumerate(FAMILIES)]
)
def test_encoder_from_a_directory_matches_the_last_hidden_state(saved: Any, family: str) -> None:
    model, path = saved[family, False]
    tokens, valid, types = tiny_batch(3)
    cfg, variables = hf.from_hf(path)
    type_ids = types if cfg.embedding.type_vocab_size else None
    ours = Encoder(cfg).apply(variables, jnp.asarray(tokens), jnp.asarray(valid),
                              token_type_ids=None if type_ids is None else jnp.asarray(type_ids))
    assert ours.shape == (3, 12, 64)
    theirs = _hidden(model, tokens, valid, type_ids)
    np.testing.assert_allclose(np.asarray(ours)[valid], theirs[valid], atol=2e-5, rtol=0)


# Forward per layer and every parameter's gradient: Post-LN (BERT) and GQA Pre-RMSNorm (Llama) by default,
# the other families with -m slow (each compiles a forward and backward pass: ~6 s on 2 CPU cores).
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("family", [f if f in ("bert", "llama") else pytest.param(f, marks=_SLOW) for f in FAMILIES])
def test_encoder_matches_transformers_forward_and_gradients(saved: Any, family: str) -> None:
    model, path = saved[family, False]
    tokens, valid, types = tiny_batch()
    report = hf.compare(model, tokens, valid, token_type_ids=types)
    assert report.ok, str(report)
    assert any(c.name == "layers_1" for c in report.checks)
    assert sum(c.kind == "grad" for c in report.checks) == len(model.state_dict())  # every parameter
    # The directory gives exactly what the model object gives.
    cfg_obj, var_obj = hf.from_hf(model)
    cfg_dir, var_dir = hf.from_hf(path)
    assert cfg_obj == cfg_dir
    jax.tree.map(np.testing.assert_array_equal, var_obj, var_dir)


def _assert_same_state_dict(got: Any, want: Any) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("head", [False, True], ids=["base", "classifier"])
@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_gives_back_the_identical_state_dict(saved: Any, family: str, head: bool) -> None:
    model, path = saved[family, head]
    cfg, variables = hf.from_hf(path)
    back = hf.to_hf(cfg, variables, family=family, pad_token_id=PAD)
    assert type(back) is type(model)
    _assert_same_state_dict(back, model)


@pytest.mark.parametrize("family", FAMILIES)
def test_classification_heads_give_the_same_logits(saved: Any, family: str) -> None:
    model, path = saved[family, True]
    tokens, valid, types = tiny_batch(1)
    cfg, variables = hf.from_hf(path)
    assert cfg.pooler.pooling == ("last" if family in ("llama", "mistral", "qwen2") else "cls")
    type_ids = jnp.asarray(types) if cfg.embedding.type_vocab_size else None
    ours = Classifier(cfg).apply(variables, jnp.asarray(tokens), jnp.asarray(valid), token_type_ids=type_ids)
    kw = {"token_type_ids": torch.from_numpy(types)} if cfg.embedding.type_vocab_size else {}
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(tokens), attention_mask=torch.from_numpy(valid.astype(np.int64)),
                       **kw).logits.numpy()
    assert ours.shape == (3, 3)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_classifier_gradients_match(saved: Any, family: str) -> None:
    model, _ = saved[family, True]
    tokens, valid, types = tiny_batch(2)
    report = hf.compare(model, tokens, valid, token_type_ids=types)
    assert report.ok, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_within_the_documented_tolerance(saved: Any, family: str) -> None:
    """Our bfloat16 compute against transformers in float32: hf.TOLERANCES['bfloat16'] holds."""
    model, _ = saved[family, False]
    tokens, valid, types = tiny_batch()
    report = hf.compare(model, tokens, valid, token_type_ids=types, dtype="bfloat16")
    assert report.ok, str(report)


def test_load_pretrained_gives_encoder_tokenizer_and_license(saved: Any, tmp_path: Path) -> None:
    path = Path(shutil.copytree(saved["bert", True][1], tmp_path / "ckpt"))
    (path / "LICENSE").write_text("Apache-2.0\n")
    (path / "tokenizer.json").write_text("{}\n")
    cfg, params, tok, lic = hf.load_pretrained(path)
    assert (tok, lic) == (path / "tokenizer.json", path / "LICENSE")
    assert cfg.pooler.pooling == "cls" and set(params) == {"embedding", "pos_embedding", "type_embedding", "embed_norm",
                                                      "stack"}
    _, variables = hf.from_hf(path)
    jax.tree.map(np.testing.assert_array_equal, params, variables["params"]["encoder"])


@pytest.mark.parametrize(("family", "cls", "prefix"), [("bert", "BertForMaskedLM", "bert."),
                                                     ("llama", "LlamaForCausalLM", "model.")])
def test_a_language_model_checkpoint_gives_its_encoder(tmp_path: Path, family: str, cls: str, prefix: str) -> None:
    """Keys under the base-model prefix, an LM head beside them: the encoder converts, the head is left out."""
    import transformers

    lm = getattr(transformers, cls)(tiny_config(family)).eval()
    lm.save_pretrained(tmp_path)
    cfg, variables = hf.from_hf(tmp_path)
    base = hf.to_hf(cfg, variables, pad_token_id=PAD)
    for k, v in base.state_dict().items():
        assert torch.equal(v, lm.state_dict()[prefix + k]), k


def test_llama_attention_biases_convert() -> None:
    """attention_bias=True: q/k/v/o biases (our qkv_bias and out_bias) with bias-free norms and FFN."""
    model = tiny_model("llama", attention_bias=True)
    assert model.layers[0].self_attn.o_proj.bias is not None
    cfg, variables = hf.from_hf(model)
    assert (cfg.block.use_bias, cfg.block.attention.qkv_bias, cfg.block.attention.out_bias) == (False, True, True)
    tokens, valid, _ = tiny_batch()
    ours = Encoder(cfg).apply(variables, jnp.asarray(tokens), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(ours)[valid], _hidden(model, tokens, valid, None)[valid], atol=2e-5, rtol=0)
    _assert_same_state_dict(hf.to_hf(cfg, variables, pad_token_id=PAD), model)


def test_default_classifier_tree_is_unchanged() -> None:
    """The new options default off: the Classifier's parameter tree is what it was."""
    cfg = EncoderConfig(num_layers=1)
    tokens = jnp.zeros((1, 4), jnp.int32)
    params = jax.eval_shape(lambda: Classifier(cfg).init(jax.random.key(0), tokens, tokens == 0))["params"]
    assert set(params) == {"encoder", "head"}
    assert set(params["encoder"]) == {"embedding", "pos_embedding", "stack"}
    assert params["encoder"]["pos_embedding"].value.shape == (cfg.max_len, 256)
    assert set(params["head"]) == {"kernel", "bias"}


def _refused(fn: Any, field: str) -> str:
    with pytest.raises(hf.UnsupportedConfigError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg and field in msg, msg
    return msg


def test_configs_we_cannot_express_are_refused_in_one_line() -> None:
    import transformers

    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 16}
    _refused(lambda: hf.from_hf(tiny_model("llama", rope_parameters=yarn)), "rope_parameters.rope_type='yarn'")
    _refused(lambda: hf.from_hf(tiny_model("llama", hidden_act="gelu")), "hidden_act='gelu'")
    _refused(lambda: hf.from_hf(tiny_model("llama", mlp_bias=True)), "mlp_bias=True")
    _refused(lambda: hf.from_hf(tiny_model("llama", head_dim=8)), "head_dim=8")
    _refused(lambda: hf.from_hf(tiny_model("mistral", sliding_window=16), max_len=32), "max_len=32")
    _refused(lambda: hf.from_hf(tiny_model("bert", position_embedding_type="relative_key")), "position_embedding_type")
    _refused(lambda: hf.from_hf(tiny_model("bert", hidden_act="silu")), "hidden_act='silu'")
    _refused(lambda: hf.from_hf(tiny_model("distilbert", sinusoidal_pos_embds=True)), "sinusoidal_pos_embds=True")
    _refused(lambda: hf.from_hf(tiny_model("bert", max_position_embeddings=64), max_len=100), "max_len=100")
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB))
    _refused(lambda: hf.from_hf(gpt2), "model_type='gpt2'")
    _refused(lambda: hf.from_hf(tiny_model("bert", head=True, num_labels=1)), "num_labels=1")


def test_a_window_covering_every_position_converts() -> None:
    """Mistral's sliding window: max_len is capped at the window, inside which attention is fully causal."""
    model = tiny_model("mistral", sliding_window=16)
    cfg, variables = hf.from_hf(model)
    assert cfg.max_len == 16
    tokens, valid, _ = tiny_batch()
    ours = Encoder(cfg).apply(variables, jnp.asarray(tokens), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(ours)[valid], _hidden(model, tokens, valid, None)[valid], atol=2e-5, rtol=0)


def test_to_hf_refuses_fields_transformers_cannot_hold() -> None:
    def bert_like(**update: Any) -> EncoderConfig:
        cfg, _ = hf.from_hf(tiny_model("bert"))
        block = cfg.block.model_copy(update=update.pop("block", {}))
        embedding = cfg.embedding.model_copy(update=update.pop("embedding", {}))
        return cfg.model_copy(update={"block": block, "embedding": embedding, **update})

    def llama_like(attention: dict[str, Any] | None = None, **block: Any) -> EncoderConfig:
        cfg, _ = hf.from_hf(tiny_model("llama"))
        attn = cfg.block.attention.model_copy(update=attention or {})
        return cfg.model_copy(update={"block": cfg.block.model_copy(update={**block, "attention": attn})})

    def refuse_to_hf(cfg: EncoderConfig, field: str, family: str | None = None) -> None:
        _refused(lambda: hf.to_hf(cfg, {"params": {}}, family=family), field)

    refuse_to_hf(bert_like(block={"norm": "pre"}), "block.norm='pre'")
    refuse_to_hf(bert_like(final_norm=True), "final_norm=True")
    refuse_to_hf(bert_like(block={"num_kv_heads": 2}), "block.num_kv_heads=2")
    refuse_to_hf(bert_like(), "embedding.position_offset=0", family="roberta")
    refuse_to_hf(bert_like(block={"norm_eps": 1e-5}, embedding={"type_vocab_size": 0}), "block.norm_eps=1e-05",
                 "distilbert")
    refuse_to_hf(llama_like(use_bias=True), "block.use_bias=True")
    refuse_to_hf(llama_like(attention={"causal": False}), "block.attention.causal=False")
    refuse_to_hf(llama_like(), "block.attention.qkv_bias=False", family="qwen2")
    refuse_to_hf(llama_like(activation="geglu"), "block.activation='geglu'")
    _refused(lambda: hf.to_hf(*hf.from_hf(tiny_model("llama")), family="gpt2"), "model_type='gpt2'")


@pytest.mark.slow
def test_importing_jaxblock_imports_neither_transformers_nor_torch() -> None:
    code = ("import sys, jaxblock, jaxblock.model, jaxblock.interop; "
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_sharded_safetensors_and_pytorch_bin_directories_read_the_same(saved: Any, tmp_path: Path) -> None:
    model, path = saved["qwen2", False]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    _, want = hf.from_hf(path)
    for source in (tmp_path / "sharded", tmp_path):
        _, got = hf.from_hf(source)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    tiny_config("bert").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or pytorch_model\.bin"):
        hf.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        hf.from_hf(tmp_path / "missing")


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    # K = 16, theta 500, original context 16: wavelengths 6.3 (< 16/2: kept), 13 (interpolated), 28.. (divided)
    {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
     "original_max_position_embeddings": 16},
], ids=["linear", "llama3"])
def test_scaled_rope_matches_and_round_trips(rope: dict[str, Any]) -> None:
    model = tiny_model("llama", rope_parameters=rope)
    cfg, variables = hf.from_hf(model)
    assert cfg.block.attention.rope_scaling is not None and cfg.block.attention.rope_scaling.type == rope["rope_type"]
    tokens, valid, _ = tiny_batch()
    ours = Encoder(cfg).apply(variables, jnp.asarray(tokens), jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(ours)[valid], _hidden(model, tokens, valid, None)[valid], atol=2e-5, rtol=0)
    back = hf.to_hf(cfg, variables, pad_token_id=PAD)
    assert back.config.rope_parameters == model.config.rope_parameters
    _assert_same_state_dict(back, model)
