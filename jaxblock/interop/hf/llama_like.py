"""Shared translation for the Llama layout: Llama, Mistral and Qwen2 (their entries in families/ bind it).

These are Pre-RMSNorm causal stacks: token embedding (no positions added), blocks
x + Attn(RMSNorm(x)), u + SwiGLU(RMSNorm(u)) with rotary positions on q/k and grouped-query attention,
and a final RMSNorm. transformers' rotary layout is rotate-half (q[:K/2], q[K/2:]), the same as ours,
so q/k weights need no permutation. Qwen2 has q/k/v biases and no out bias (our attention.qkv_bias/out_bias).
The *ForSequenceClassification heads score every token with a bias-free `score` and read the last
non-pad token: with right padding that is our pooler.pooling='last'.

Only exact equivalents convert: RoPE types 'default', 'linear' and 'llama3' (any rope_theta), full-width
rotary, head_dim = D / H, SiLU gate, no MLP bias; a sliding window only when it covers every position we allow.
"""

from __future__ import annotations

from typing import Any

from jaxblock.config import EncoderConfig
from jaxblock.interop.hf.common import Mapping, check_all, linear, norm, refuse, refuse_extras


def _rope(c: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, our rope_scaling or None) from the config's rope_parameters."""
    params = c.get("rope_parameters") or {}
    if "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    if not params and c.get("rope_scaling"):  # config.json written before transformers 5
        old = dict(c.rope_scaling)
        params = old | {"rope_type": old.get("rope_type", old.get("type", "default"))}
    kind = params.get("rope_type", "default")
    factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise refuse("partial_rotary_factor", factor, "jaxblock rotates the whole head")
    base = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if kind == "default":
        return base, None
    if kind == "linear":
        return base, {"type": "linear", "factor": params["factor"]}
    if kind == "llama3":
        return base, {"type": "llama3", "factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
                      "high_freq_factor": params["high_freq_factor"],
                      "original_max_len": params["original_max_position_embeddings"]}
    raise refuse("rope_parameters.rope_type", kind, "jaxblock implements RoPE 'default', 'linear' and 'llama3'")


def _window(c: Any, family: str) -> int | None:
    """The sliding window in force (None = full causal attention)."""
    window = c.get("sliding_window")
    if family == "qwen2":
        use = bool(c.get("use_sliding_window", False))
        types = c.get("layer_types") or [  # as Qwen2Config derives them when config.json has none
            "sliding_attention" if use and i >= c.get("max_window_layers", 28) else "full_attention"
            for i in range(c.num_hidden_layers)]
        if not use or "sliding_attention" not in types:
            return None
    return window


def encoder_fields(c: Any, max_len: int | None, *, family: str) -> dict[str, Any]:
    if c.hidden_act != "silu":
        raise refuse("hidden_act", c.hidden_act, "only the SiLU gate (SwiGLU) converts")
    head_dim = c.get("head_dim") or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise refuse("head_dim", head_dim, f"jaxblock's head width is hidden_size / num_attention_heads "
                     f"= {c.hidden_size / c.num_attention_heads:g}")
    if c.get("mlp_bias", False):
        raise refuse("mlp_bias", True, "bias-free RMSNorm blocks with FFN biases are not expressible")
    base, scaling = _rope(c)
    longest = c.max_position_embeddings
    window = _window(c, family)
    if window is not None:
        if max_len is not None and max_len > window:
            raise refuse("max_len", max_len, f"sliding_window={window} would hide keys further back: "
                         f"pass max_len <= {window} (full causal attention within it)")
        longest = min(longest, window)
    if max_len is not None and max_len > c.max_position_embeddings:
        raise refuse("max_len", max_len, f"the checkpoint allows {c.max_position_embeddings} positions")
    attn_bias = bool(c.get("attention_bias", False))
    kv_heads = c.get("num_key_value_heads") or c.num_attention_heads  # None: as many as query heads
    return dict(
        num_layers=c.num_hidden_layers, vocab_size=c.vocab_size, max_len=max_len or longest,
        embedding=dict(positions="none"),
        block=dict(
            model_dim=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=kv_heads,
            ffn_dim=c.intermediate_size, norm="pre", norm_type="rmsnorm", norm_eps=c.rms_norm_eps,
            activation="swiglu", use_bias=False, init="torch",
            attention=dict(
                qkv_bias=True if family == "qwen2" else attn_bias, out_bias=False if family == "qwen2" else attn_bias,
                causal=True, rope=True, rope_base=base, rope_scaling=scaling,
                dropout=float(c.attention_dropout or 0.0),
            ),
        ),
    )


def head_fields(c: Any) -> dict[str, Any]:
    return {"pooling": "last"}  # PoolerConfig fields


def encoder_map(cfg: EncoderConfig) -> list[Mapping]:
    b = cfg.block
    rows = [Mapping("embed_tokens.weight", ("embedding",), "same"), *norm("norm", ("stack", "final_norm"), bias=False)]
    for i in range(cfg.num_layers):
        hf, ours = f"layers.{i}", ("stack", f"layers_{i}")
        for proj, name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            rows += linear(f"{hf}.self_attn.{name}", (*ours, "self_attn", proj), bias=b.has_qkv_bias, bias_flat=True)
        rows += linear(f"{hf}.self_attn.o_proj", (*ours, "self_attn", "out"), bias=b.has_out_bias, n_in=2)
        rows += linear(f"{hf}.mlp.gate_proj", (*ours, "ffn", "gate"), bias=False)
        rows += linear(f"{hf}.mlp.up_proj", (*ours, "ffn", "linear1"), bias=False)
        rows += linear(f"{hf}.mlp.down_proj", (*ours, "ffn", "linear2"), bias=False)
        rows += norm(f"{hf}.input_layernorm", (*ours, "attn_norm"), bias=False)
        rows += norm(f"{hf}.post_attention_layernorm", (*ours, "ffn_norm"), bias=False)
    return rows


def head_map(cfg: EncoderConfig) -> list[Mapping]:
    return linear("score", ("head",), bias=False)


def _rope_parameters(cfg: EncoderConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.block.attention.rope_base}
    sc = cfg.block.attention.rope_scaling
    if sc is not None:
        out |= {"rope_type": sc.type, "factor": sc.factor}
        if sc.type == "llama3":
            out |= {"low_freq_factor": sc.low_freq_factor, "high_freq_factor": sc.high_freq_factor,
                    "original_max_position_embeddings": sc.original_max_len}
    return out


def hf_config(cfg: EncoderConfig, classifier: bool, *, family: str) -> dict[str, Any]:
    """EncoderConfig -> transformers config keyword arguments, refusing what the family cannot hold."""
    b, a, e = cfg.block, cfg.block.attention, cfg.embedding
    refuse_extras(cfg, family)
    qkv, out = b.has_qkv_bias, b.has_out_bias
    bias_ok = (qkv and not out) if family == "qwen2" else qkv == out
    only_attn = "only attention weights have dropout"
    checks: list[tuple[str, Any, bool, str]] = [
        ("block.norm", b.norm, b.norm != "pre", "this family is Pre-LN"),
        ("block.norm_type", b.norm_type, b.norm_type != "rmsnorm", "this family uses RMSNorm"),
        ("block.activation", b.activation, b.activation != "swiglu", "the FFN is SwiGLU"),
        ("block.use_bias", b.use_bias, b.use_bias, "norms and FFN have no biases"),
        ("block.attention.qkv_bias", a.qkv_bias, not bias_ok,
         "Qwen2 has q/k/v biases without an out bias" if family == "qwen2" else "q/k/v/o biases go together"),
        ("block.attention.causal", a.causal, not a.causal, "this family is causal"),
        ("block.attention.rope", a.rope, not a.rope, "positions are rotary"),
        ("final_norm", cfg.final_norm, not cfg.has_final_norm, "there is a final norm"),
        ("embedding.norm", e.norm, e.norm, "the embedding is not normalized"),
        ("embedding.type_vocab_size", e.type_vocab_size, e.type_vocab_size != 0, "there are no token types"),
        ("block.ablate", b.ablate, b.ablate != "none", "both branches exist"),
        ("block.ffn_dropout", b.ffn_dropout, b.ffn_dropout != 0.0, only_attn),
        ("block.residual_dropout", b.residual_dropout, b.residual_dropout != 0.0, only_attn),
        ("embedding.dropout", e.dropout, e.dropout != 0.0, only_attn),
        ("pooler.pooling", cfg.pooler.pooling, classifier and cfg.pooler.pooling != "last",
         "the head reads the last token"),
        ("family", family, family == "mistral" and (qkv or out), "Mistral has no attention biases"),
    ]
    check_all(checks, family)
    kw: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=b.model_dim, intermediate_size=b.ffn_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=b.num_heads, num_key_value_heads=b.kv_heads,
        hidden_act="silu", max_position_embeddings=cfg.max_len, rms_norm_eps=b.norm_eps,
        rope_parameters=_rope_parameters(cfg), attention_dropout=a.dropout,
        num_labels=cfg.num_classes, tie_word_embeddings=False,
    )
    if family == "llama":
        return kw | dict(attention_bias=qkv, mlp_bias=False, head_dim=b.head_dim)
    if family == "mistral":
        return kw | dict(sliding_window=None, head_dim=b.head_dim)
    return kw | dict(use_sliding_window=False)


def matches(cfg: EncoderConfig, *, family: str) -> bool:
    """Whether to_hf should read this config as `family` when none is named (Mistral only when named)."""
    b = cfg.block
    if not b.attention.rope:
        return False
    qwen = b.has_qkv_bias and not b.has_out_bias
    return qwen if family == "qwen2" else (family == "llama" and not qwen)
