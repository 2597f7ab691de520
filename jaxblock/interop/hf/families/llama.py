"""Llama: Pre-RMSNorm causal stack, SwiGLU, RoPE (default, linear, llama3), GQA, final norm; `score` head."""

from functools import partial

from jaxblock.interop.hf import llama_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="llama", model_types=("llama",), hf_class="Llama", prefix="model",
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_parameters=None, attention_bias=False, attention_dropout=0.0,
                  mlp_bias=False, head_dim=None, pad_token_id=None),
    encoder_fields=partial(llama_like.encoder_fields, family="llama"),
    encoder_map=llama_like.encoder_map, head_fields=llama_like.head_fields, head_map=llama_like.head_map,
    hf_config=partial(llama_like.hf_config, family="llama"),
    matches=partial(llama_like.matches, family="llama"), priority=40,
)
