"""ELECTRA (the discriminator's encoder): BERT's layout with embeddings of width embedding_size, projected
to hidden_size by `embeddings_project` when the two differ (our embedding.dim and embed_proj). Its
sequence-classification head: classifier.dense + GELU (whatever hidden_act is) + classifier.out_proj."""

from functools import partial

from jaxblock.interop.hf import bert_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="electra", model_types=("electra",), hf_class="Electra", prefix="electra",
    defaults=dict(vocab_size=30522, embedding_size=128, hidden_size=256, num_hidden_layers=12,
                  num_attention_heads=4, intermediate_size=1024, hidden_act="gelu", hidden_dropout_prob=0.1,
                  attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
                  layer_norm_eps=1e-12, pad_token_id=0, is_decoder=False, add_cross_attention=False),
    encoder_fields=partial(bert_like.encoder_fields, layout="bert"),
    encoder_map=partial(bert_like.encoder_map, layout="bert"),
    head_fields=lambda c: {"pooling": "cls", "activation": "gelu"},
    head_map=lambda cfg: bert_like.head_map("classifier.dense", "classifier.out_proj"),
    hf_config=partial(bert_like.hf_config, layout="bert", family="electra", pooler_activation="gelu",
                      embed_proj=True),
    matches=lambda cfg: cfg.embedding.positions == "learned" and cfg.embed_width != cfg.block.model_dim, priority=20,
)
