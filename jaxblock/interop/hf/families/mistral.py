"""Mistral: Llama's layout without attention biases, with a sliding window (read when it covers max_len)."""

from functools import partial

from jaxblock.interop.hf import llama_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="mistral", model_types=("mistral",), hf_class="Mistral", prefix="model",
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                  max_position_embeddings=131072, rms_norm_eps=1e-6, rope_parameters=None, sliding_window=4096,
                  attention_dropout=0.0, pad_token_id=None),
    encoder_fields=partial(llama_like.encoder_fields, family="mistral"),
    encoder_map=llama_like.encoder_map, head_fields=llama_like.head_fields, head_map=llama_like.head_map,
    hf_config=partial(llama_like.hf_config, family="mistral"),
    matches=None,  # reads like Llama: to_hf writes Mistral only when named
)
