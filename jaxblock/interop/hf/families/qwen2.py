"""Qwen2: Llama's layout with q/k/v biases and no out-projection bias."""

from functools import partial

from jaxblock.interop.hf import llama_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="qwen2", model_types=("qwen2",), hf_class="Qwen2", prefix="model",
    defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_parameters=None, use_sliding_window=False, sliding_window=4096,
                  max_window_layers=28, layer_types=None, attention_dropout=0.0, pad_token_id=None),
    encoder_fields=partial(llama_like.encoder_fields, family="qwen2"),
    encoder_map=llama_like.encoder_map, head_fields=llama_like.head_fields, head_map=llama_like.head_map,
    hf_config=partial(llama_like.hf_config, family="qwen2"),
    matches=partial(llama_like.matches, family="qwen2"), priority=35,
)
