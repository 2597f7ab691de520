"""ModernBERT: a Pre-LN encoder without biases (attention_bias = mlp_bias = norm_bias = False by default),
GeGLU FFN (Wi holds [input; gate], GELU on the input half), a LayerNorm on the token embedding, a final
norm, no attention norm in layer 0 (it reads the embedding norm's output), RoPE with one base for global
layers and another for local ones, and bidirectional sliding-window attention on the local layers (every
layer but each global_attn_every_n_layers-th): a local query sees keys at most local_attention // 2
positions away. Those per-layer differences are the stack's layers.window / layers.rope_base /
layers.attn_norm. The sequence-classification head pools (classifier_pooling 'cls' or 'mean'), then
head.dense (bias classifier_bias) + classifier_activation + head.norm, then `classifier`.
"""

from __future__ import annotations

from typing import Any

from jaxblock.config import EncoderConfig
from jaxblock.interop.hf.common import Mapping, check_all, linear, norm, refuse, refuse_extras
from jaxblock.interop.hf.family import Family

_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
    hidden_activation="gelu", max_position_embeddings=8192, norm_eps=1e-5, norm_bias=False, pad_token_id=50283,
    attention_bias=False, attention_dropout=0.0, layer_types=None, rope_parameters=None, local_attention=128,
    embedding_dropout=0.0, mlp_bias=False, mlp_dropout=0.0, classifier_pooling="cls", classifier_dropout=0.0,
    classifier_bias=False, classifier_activation="gelu",
    # config.json files written before transformers 5 (ModernBertConfig still reads them):
    global_attn_every_n_layers=3, global_rope_theta=160000.0, local_rope_theta=10000.0,
)
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _layer_types(c: Any) -> list[str]:
    types = c.get("layer_types") or [_SLIDING if i % c.global_attn_every_n_layers else _FULL
                                      for i in range(c.num_hidden_layers)]
    if len(types) != c.num_hidden_layers or set(types) - {_SLIDING, _FULL}:
        raise refuse("layer_types", types, f"give {c.num_hidden_layers} entries, each {_FULL!r} or {_SLIDING!r}")
    return list(types)


def _theta(c: Any, kind: str) -> float:
    params = (c.get("rope_parameters") or {}).get(kind) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise refuse(f"rope_parameters.{kind}.rope_type", rope_type, "jaxblock reads ModernBERT's default RoPE only")
    old = c.global_rope_theta if kind == _FULL else c.local_rope_theta
    return float(params.get("rope_theta", old))


def encoder_fields(c: Any, max_len: int | None) -> dict[str, Any]:
    if c.hidden_activation != "gelu":
        raise refuse("hidden_activation", c.hidden_activation, "jaxblock's GeGLU uses the exact GELU ('gelu')")
    biases = {"attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias, "norm_bias": c.norm_bias}
    if len(set(biases.values())) > 1:
        raise refuse("mlp_bias", c.mlp_bias, f"jaxblock's use_bias covers every bias; here {biases}: set them equal")
    if c.hidden_size % c.num_attention_heads:
        raise refuse("num_attention_heads", c.num_attention_heads, "must divide hidden_size")
    if c.attention_dropout:
        raise refuse("attention_dropout", c.attention_dropout, "ModernBERT drops the attention weights and the "
                     "attention output at one rate, jaxblock has no dropout on that branch alone: set it to 0")
    if max_len is not None and max_len > c.max_position_embeddings:
        raise refuse("max_len", max_len, f"the checkpoint allows {c.max_position_embeddings} positions")
    types = _layer_types(c)
    window = c.local_attention // 2
    return dict(
        num_layers=c.num_hidden_layers, vocab_size=c.vocab_size, max_len=max_len or c.max_position_embeddings,
        embedding=dict(positions="none", norm=True, dropout=float(c.embedding_dropout)),
        layers=dict(
            window=tuple(window if t == _SLIDING else None for t in types),
            rope_base=tuple(_theta(c, t) for t in types),
            attn_norm=tuple(i > 0 for i in range(c.num_hidden_layers)),
        ),
        block=dict(
            model_dim=c.hidden_size, num_heads=c.num_attention_heads, ffn_dim=c.intermediate_size, norm="pre",
            norm_type="layernorm", norm_eps=c.norm_eps, activation="geglu", use_bias=bool(c.norm_bias),
            ffn_dropout=float(c.mlp_dropout), init="torch", attention=dict(rope=True),
        ),
    )


def head_fields(c: Any) -> dict[str, Any]:
    if c.classifier_activation != "gelu":
        raise refuse("classifier_activation", c.classifier_activation, "jaxblock's pooler reads 'gelu' here")
    if c.classifier_pooling not in ("cls", "mean"):
        raise refuse("classifier_pooling", c.classifier_pooling, "use 'cls' or 'mean'")
    return {"pooling": c.classifier_pooling, "dense": True, "activation": "gelu", "norm": True,
            "bias": bool(c.classifier_bias)}


def encoder_map(cfg: EncoderConfig) -> list[Mapping]:
    bias = cfg.block.use_bias
    rows = [Mapping("embeddings.tok_embeddings.weight", ("embedding",), "same"),
            *norm("embeddings.norm", ("embed_norm",), bias=bias),
            *norm("final_norm", ("stack", "final_norm"), bias=bias)]
    skip = cfg.layers.attn_norm or (True,) * cfg.num_layers
    for i in range(cfg.num_layers):
        hf, ours = f"layers.{i}", ("stack", f"layers_{i}")
        if skip[i]:
            rows += norm(f"{hf}.attn_norm", (*ours, "attn_norm"), bias=bias)
        else:  # transformers has an Identity here; our unused norm reads as ones
            rows += [Mapping("", (*ours, "attn_norm", "scale"), "ones")]
            rows += [Mapping("", (*ours, "attn_norm", "bias"), "ones")] if bias else []
        for j, proj in enumerate(("query", "key", "value")):
            rows += linear(f"{hf}.attn.Wqkv", (*ours, "self_attn", proj), bias=bias, bias_flat=True, part=(j, 3))
        rows += linear(f"{hf}.attn.Wo", (*ours, "self_attn", "out"), bias=bias, n_in=2)
        rows += norm(f"{hf}.mlp_norm", (*ours, "ffn_norm"), bias=bias)
        rows += linear(f"{hf}.mlp.Wi", (*ours, "ffn", "gate"), bias=bias, part=(0, 2))  # GELU'd half
        rows += linear(f"{hf}.mlp.Wi", (*ours, "ffn", "linear1"), bias=bias, part=(1, 2))
        rows += linear(f"{hf}.mlp.Wo", (*ours, "ffn", "linear2"), bias=bias)
    return rows


def head_map(cfg: EncoderConfig) -> list[Mapping]:
    return (linear("head.dense", ("pooler",), bias=cfg.pooler.bias)
            + norm("head.norm", ("pooler_norm",), bias=cfg.block.use_bias) + linear("classifier", ("head",), bias=True))


def hf_config(cfg: EncoderConfig, classifier: bool) -> dict[str, Any]:
    b, a, e, layers, pooler = cfg.block, cfg.block.attention, cfg.embedding, cfg.layers, cfg.pooler
    refuse_extras(cfg, "modernbert", allowed=("layers.window", "layers.rope_base", "layers.attn_norm", "pooler.dense",
                                              "pooler.norm", "pooler.bias"))
    windows = layers.window or (None,) * cfg.num_layers
    local = {w for w in windows if w is not None}
    bases = layers.rope_base or (a.rope_base,) * cfg.num_layers
    by_type = {(w is None, base) for w, base in zip(windows, bases, strict=True)}
    first_norm = tuple(i > 0 for i in range(cfg.num_layers))
    checks: list[tuple[str, Any, bool, str]] = [
        ("block.norm", b.norm, b.norm != "pre", "this family is Pre-LN"),
        ("block.norm_type", b.norm_type, b.norm_type != "layernorm", "this family uses LayerNorm"),
        ("block.activation", b.activation, b.activation != "geglu", "the FFN is GeGLU"),
        ("block.attention.qkv_bias", a.qkv_bias, b.has_qkv_bias != b.use_bias, "one flag covers every bias"),
        ("block.attention.out_bias", a.out_bias, b.has_out_bias != b.use_bias, "one flag covers every bias"),
        ("block.num_kv_heads", b.num_kv_heads, b.kv_heads != b.num_heads, "no grouped-query attention here"),
        ("block.attention.causal", a.causal, a.causal, "this family is bidirectional"),
        ("block.ablate", b.ablate, b.ablate != "none", "both branches exist"),
        ("block.attention.rope_scaling", a.rope_scaling, a.rope_scaling is not None, "RoPE is unscaled here"),
        ("block.attention.dropout", a.dropout, a.dropout != 0.0, "see attention_dropout when reading"),
        ("block.residual_dropout", b.residual_dropout, b.residual_dropout != 0.0, "no residual dropout here"),
        ("block.attention.rope", a.rope, not a.rope, "positions are rotary"),
        ("final_norm", cfg.final_norm, not cfg.has_final_norm, "there is a final norm"),
        ("embedding.norm", e.norm, not e.norm, "the embedding is normalized"),
        ("embedding.type_vocab_size", e.type_vocab_size, e.type_vocab_size != 0, "there are no token types"),
        ("layers.window", layers.window, len(local) > 1, "every local layer has one window"),
        ("layers.rope_base", layers.rope_base, len(by_type) > 2 or len({g for g, _ in by_type}) < len(by_type),
         "one RoPE base for global layers and one for local layers"),
        ("layers.attn_norm", layers.attn_norm, (layers.attn_norm or (True,) * cfg.num_layers) != first_norm,
         "only layer 0 goes without its attention norm"),
    ]
    if classifier:
        checks += [
            ("pooler.pooling", pooler.pooling, pooler.pooling not in ("cls", "mean"),
             "the head pools by 'cls' or 'mean'"),
            ("pooler.dense", pooler.dense, not pooler.has_dense, "the head has a dense layer"),
            ("pooler.activation", pooler.activation, pooler.activation != "gelu", "the head's is gelu"),
            ("pooler.norm", pooler.norm, not pooler.norm, "the head has a norm after its activation"),
        ]
    check_all(checks, "modernbert")
    theta = {("full" if glob else "local"): base for glob, base in by_type}
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=b.model_dim, intermediate_size=b.ffn_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=b.num_heads, hidden_activation="gelu",
        max_position_embeddings=cfg.max_len, norm_eps=b.norm_eps, norm_bias=b.use_bias,
        attention_bias=b.use_bias, mlp_bias=b.use_bias, mlp_dropout=b.ffn_dropout,
        embedding_dropout=e.dropout, attention_dropout=0.0,
        layer_types=[_FULL if w is None else _SLIDING for w in windows],
        local_attention=2 * (local.pop() if local else 64),
        rope_parameters={_FULL: {"rope_type": "default", "rope_theta": theta.get("full", a.rope_base)},
                         _SLIDING: {"rope_type": "default", "rope_theta": theta.get("local", a.rope_base)}},
        classifier_pooling=pooler.pooling if pooler.pooling in ("cls", "mean") else "cls",
        classifier_bias=pooler.bias, classifier_activation="gelu", num_labels=cfg.num_classes,
    )


FAMILY = Family(
    name="modernbert", model_types=("modernbert",), hf_class="ModernBert", prefix="model", defaults=_DEFAULTS,
    encoder_fields=encoder_fields, encoder_map=encoder_map, head_fields=head_fields, head_map=head_map,
    hf_config=hf_config,
    matches=lambda cfg: cfg.block.attention.rope and cfg.embedding.norm and cfg.block.norm_type == "layernorm",
    priority=25,
)
