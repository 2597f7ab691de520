"""RoBERTa: BERT's architecture with positions from padding_idx + 1 and a classifier.dense/out_proj head."""

from functools import partial

from jaxblock.interop.hf import bert_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="roberta", model_types=("roberta",), hf_class="Roberta", prefix="roberta",
    defaults=dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                  attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
                  layer_norm_eps=1e-12, pad_token_id=1, is_decoder=False, add_cross_attention=False),
    encoder_fields=partial(bert_like.encoder_fields, layout="roberta"),
    encoder_map=partial(bert_like.encoder_map, layout="roberta"),
    head_fields=lambda c: {"pooling": "cls", "activation": "tanh"},
    head_map=lambda cfg: bert_like.head_map("classifier.dense", "classifier.out_proj"),
    hf_config=partial(bert_like.hf_config, layout="roberta", family="roberta", pooler_activation="tanh"),
    matches=partial(bert_like.matches, layout="roberta"), priority=30,
    base_kwargs={"add_pooling_layer": False},
)
