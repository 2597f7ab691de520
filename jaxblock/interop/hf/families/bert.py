"""BERT: Post-LN, learned positions, token types, pooler dense + tanh before the classifier."""

from functools import partial

from jaxblock.interop.hf import bert_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="bert", model_types=("bert",), hf_class="Bert", prefix="bert",
    defaults=dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                  attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
                  layer_norm_eps=1e-12, pad_token_id=0, is_decoder=False, add_cross_attention=False),
    encoder_fields=partial(bert_like.encoder_fields, layout="bert"),
    encoder_map=partial(bert_like.encoder_map, layout="bert"),
    head_fields=lambda c: {"pooling": "cls", "activation": "tanh"},
    head_map=lambda cfg: bert_like.head_map("bert.pooler.dense", "classifier"),
    hf_config=partial(bert_like.hf_config, layout="bert", family="bert", pooler_activation="tanh"),
    matches=partial(bert_like.matches, layout="bert"), priority=30,
    base_kwargs={"add_pooling_layer": False},
)
