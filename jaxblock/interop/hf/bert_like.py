"""Shared translation for the Post-LN BERT layouts: 'bert' (BERT, ELECTRA), 'roberta' (RoBERTa,
XLM-RoBERTa, CamemBERT) and 'distilbert'. The family entries in families/ bind a layout.

These are Post-LN encoders: word (+ token-type) + learned position embeddings, an embedding LayerNorm,
then blocks LN1(x + MHA(x)), LN2(u + FFN(u)), no final norm. RoBERTa counts positions from
padding_idx + 1 (our `embedding.position_offset`); right-padded rows then get the same positions as in
transformers at every real token. ELECTRA's embeddings may be narrower than the blocks (embedding_size,
our embedding.dim) and are then projected by `embeddings_project` (our embed_proj). The sequence-classification
heads all read token 0 ([CLS] / <s>): BERT's pooler dense+tanh then `classifier`, RoBERTa's
`classifier.dense`+tanh then `classifier.out_proj`, ELECTRA's the same names with GELU, DistilBERT's
`pre_classifier`+ReLU then `classifier`: our pooler.pooling='cls' with the matching activation.
"""

from __future__ import annotations

from typing import Any, Literal

from jaxblock.config import EncoderConfig
from jaxblock.interop.hf.common import Mapping, check_all, linear, norm, refuse, refuse_extras

Layout = Literal["bert", "roberta", "distilbert"]

# transformers' hidden_act -> our activation (only exact equivalents)
_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_ACTIVATIONS_BACK = {"gelu": "gelu", "relu": "relu", "gelu_tanh": "gelu_pytorch_tanh"}


def encoder_fields(c: Any, max_len: int | None, *, layout: Layout) -> dict[str, Any]:
    """A transformers config -> EncoderConfig keyword arguments (refusing what we cannot express)."""
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise refuse("is_decoder", True, "decoder/cross-attention BERTs are not encoders: use an encoder checkpoint")
    embed_dim = None
    if layout == "distilbert":
        if c.sinusoidal_pos_embds:
            raise refuse("sinusoidal_pos_embds", True, "frozen sinusoidal positions are not converted: "
                         "use a checkpoint with learned positions")
        act, eps, offset, types = c.activation, 1e-12, 0, 0
        dims = dict(model_dim=c.dim, num_heads=c.n_heads, ffn_dim=c.hidden_dim)
        drop, attn_drop, layers, max_pos = c.dropout, c.attention_dropout, c.n_layers, c.max_position_embeddings
    else:
        pet = c.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise refuse("position_embedding_type", pet, "only absolute positions convert")
        act, eps, types = c.hidden_act, c.layer_norm_eps, c.type_vocab_size
        offset = c.pad_token_id + 1 if layout == "roberta" else 0
        dims = dict(model_dim=c.hidden_size, num_heads=c.num_attention_heads, ffn_dim=c.intermediate_size)
        drop, attn_drop = c.hidden_dropout_prob, c.attention_probs_dropout_prob
        layers, max_pos = c.num_hidden_layers, c.max_position_embeddings
        size = c.get("embedding_size")
        embed_dim = size if size is not None and size != c.hidden_size else None
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise refuse("hidden_act", act, f"no exact jaxblock activation: use one of {sorted(_ACTIVATIONS)}")
    longest = max_pos - offset
    if max_len is not None and max_len > longest:
        raise refuse("max_len", max_len, f"the checkpoint has positions for {longest} tokens: pass at most that")
    return dict(
        num_layers=layers, vocab_size=c.vocab_size, max_len=max_len or longest,
        embedding=dict(positions="learned", position_offset=offset, type_vocab_size=types, norm=True, dropout=drop,
                       dim=embed_dim),
        block=dict(
            **dims, norm="post", norm_type="layernorm", norm_eps=eps, activation=_ACTIVATIONS[act],
            use_bias=True, residual_dropout=drop, ffn_dropout=0.0, init="torch", attention=dict(dropout=attn_drop),
        ),
    )


def encoder_map(cfg: EncoderConfig, *, layout: Layout) -> list[Mapping]:
    """transformers names (without the base-model prefix) -> our Encoder params paths."""
    rows = [
        Mapping("embeddings.word_embeddings.weight", ("embedding",), "same"),
        Mapping("embeddings.position_embeddings.weight", ("pos_embedding",), "same"),
        *norm("embeddings.LayerNorm", ("embed_norm",), bias=True),
    ]
    if layout != "distilbert":
        rows.append(Mapping("embeddings.token_type_embeddings.weight", ("type_embedding",), "same"))
    if cfg.embed_width != cfg.block.model_dim:
        rows += linear("embeddings_project", ("embed_proj",), bias=True)
    for i in range(cfg.num_layers):
        ours = ("stack", f"layers_{i}")
        if layout == "distilbert":
            hf = f"transformer.layer.{i}"
            names = {"query": "attention.q_lin", "key": "attention.k_lin", "value": "attention.v_lin",
                     "out": "attention.out_lin", "attn_norm": "sa_layer_norm", "linear1": "ffn.lin1",
                     "linear2": "ffn.lin2", "ffn_norm": "output_layer_norm"}
        else:
            hf = f"encoder.layer.{i}"
            names = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
                     "out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
                     "linear1": "intermediate.dense", "linear2": "output.dense", "ffn_norm": "output.LayerNorm"}
        for proj in ("query", "key", "value"):
            rows += linear(f"{hf}.{names[proj]}", (*ours, "self_attn", proj), bias=True, bias_flat=True)
        rows += linear(f"{hf}.{names['out']}", (*ours, "self_attn", "out"), bias=True, n_in=2)
        rows += norm(f"{hf}.{names['attn_norm']}", (*ours, "attn_norm"), bias=True)
        rows += linear(f"{hf}.{names['linear1']}", (*ours, "ffn", "linear1"), bias=True)
        rows += linear(f"{hf}.{names['linear2']}", (*ours, "ffn", "linear2"), bias=True)
        rows += norm(f"{hf}.{names['ffn_norm']}", (*ours, "ffn_norm"), bias=True)
    return rows


def head_map(pooler: str, head: str) -> list[Mapping]:
    """A *ForSequenceClassification head: pooler dense and output layer (full transformers names)."""
    return linear(pooler, ("pooler",), bias=True) + linear(head, ("head",), bias=True)


def hf_config(
    cfg: EncoderConfig, classifier: bool, *, layout: Layout, family: str, pooler_activation: str,
    embed_proj: bool = False,
) -> dict[str, Any]:
    """EncoderConfig -> transformers config keyword arguments, refusing (one line, naming the field) what
    the family cannot hold."""
    b, a, e = cfg.block, cfg.block.attention, cfg.embedding
    refuse_extras(cfg, family, allowed=("embedding.dim",) if embed_proj else ())
    checks: list[tuple[str, Any, bool, str]] = [
        ("block.norm", b.norm, b.norm != "post", "this family is Post-LN"),
        ("block.norm_type", b.norm_type, b.norm_type != "layernorm", "this family uses LayerNorm"),
        ("block.activation", b.activation, b.activation not in _ACTIVATIONS_BACK, "use gelu, gelu_tanh or relu"),
        ("block.use_bias", b.use_bias, not b.use_bias, "every projection and norm has a bias here"),
        ("block.attention.qkv_bias", a.qkv_bias, not b.has_qkv_bias, "q/k/v always have biases here"),
        ("block.attention.out_bias", a.out_bias, not b.has_out_bias, "the out-projection always has a bias here"),
        ("block.num_kv_heads", b.num_kv_heads, b.kv_heads != b.num_heads, "no grouped-query attention here"),
        ("block.attention.causal", a.causal, a.causal, "this family is bidirectional"),
        ("block.ablate", b.ablate, b.ablate != "none", "both branches exist"),
        ("block.ffn_dropout", b.ffn_dropout, b.ffn_dropout != 0.0, "there is no dropout inside the FFN"),
        ("final_norm", cfg.final_norm, cfg.has_final_norm, "there is no norm after the last block"),
        ("block.attention.rope", a.rope, a.rope, "positions are a learned table"),
        ("embedding.positions", e.positions, e.positions != "learned", "positions are a learned table"),
        ("embedding.norm", e.norm, not e.norm, "the embeddings are always normalized"),
        ("embedding.dropout", e.dropout, e.dropout != b.residual_dropout,
         "one hidden dropout rate covers embeddings and residual branches: set them equal"),
    ]
    if layout == "distilbert":
        checks += [
            ("block.norm_eps", b.norm_eps, b.norm_eps != 1e-12, "DistilBERT's LayerNorm eps is fixed at 1e-12"),
            ("block.activation", b.activation, b.activation == "gelu_tanh", "DistilBERT has gelu or relu"),
            ("embedding.type_vocab_size", e.type_vocab_size, e.type_vocab_size != 0, "DistilBERT has no token types"),
        ]
    else:
        checks.append(("embedding.type_vocab_size", e.type_vocab_size, e.type_vocab_size == 0, "needs at least 1 type"))
    if layout == "roberta":
        checks.append(("embedding.position_offset", e.position_offset, e.position_offset < 1,
                       "RoBERTa's positions start at pad_token_id + 1 >= 1"))
    else:
        checks.append(("embedding.position_offset", e.position_offset, e.position_offset != 0, "positions start at 0"))
    if classifier:
        checks += [
            ("pooler.pooling", cfg.pooler.pooling, cfg.pooler.pooling != "cls",
             "the head reads the first token: use pooling='cls'"),
            ("pooler.activation", cfg.pooler.activation, cfg.pooler.activation != pooler_activation,
             f"this head's activation is {pooler_activation}"),
        ]
    check_all(checks, family)
    common = dict(vocab_size=cfg.vocab_size, num_labels=cfg.num_classes)
    if layout == "distilbert":
        return common | dict(
            dim=b.model_dim, n_heads=b.num_heads, hidden_dim=b.ffn_dim, n_layers=cfg.num_layers,
            activation=b.activation, dropout=b.residual_dropout, attention_dropout=a.dropout,
            max_position_embeddings=cfg.max_len, sinusoidal_pos_embds=False)
    kw = common | dict(
        hidden_size=b.model_dim, num_attention_heads=b.num_heads, intermediate_size=b.ffn_dim,
        num_hidden_layers=cfg.num_layers, hidden_act=_ACTIVATIONS_BACK[b.activation],
        hidden_dropout_prob=b.residual_dropout, attention_probs_dropout_prob=a.dropout,
        max_position_embeddings=cfg.max_len + e.position_offset, type_vocab_size=e.type_vocab_size,
        layer_norm_eps=b.norm_eps)
    if embed_proj:
        kw["embedding_size"] = cfg.embed_width
    if layout == "roberta":
        kw["pad_token_id"] = e.position_offset - 1
    return kw


def matches(cfg: EncoderConfig, *, layout: Layout) -> bool:
    """Whether to_hf should read this config as the layout's base family when none is named."""
    e = cfg.embedding
    if e.positions != "learned":
        return False
    if layout == "roberta":
        return e.position_offset > 0
    return e.position_offset == 0 and bool(e.type_vocab_size) == (layout == "bert")
