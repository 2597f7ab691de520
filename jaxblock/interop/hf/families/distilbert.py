"""DistilBERT: BERT without token types (own parameter names), pre_classifier + ReLU before the classifier."""

from functools import partial

from jaxblock.interop.hf import bert_like
from jaxblock.interop.hf.family import Family

FAMILY = Family(
    name="distilbert", model_types=("distilbert",), hf_class="DistilBert", prefix="distilbert",
    defaults=dict(vocab_size=30522, max_position_embeddings=512, sinusoidal_pos_embds=False, n_layers=6,
                  n_heads=12, dim=768, hidden_dim=3072, dropout=0.1, attention_dropout=0.1, activation="gelu",
                  pad_token_id=0),
    encoder_fields=partial(bert_like.encoder_fields, layout="distilbert"),
    encoder_map=partial(bert_like.encoder_map, layout="distilbert"),
    head_fields=lambda c: {"pooling": "cls", "activation": "relu"},
    head_map=lambda cfg: bert_like.head_map("pre_classifier", "classifier"),
    hf_config=partial(bert_like.hf_config, layout="distilbert", family="distilbert", pooler_activation="relu"),
    matches=partial(bert_like.matches, layout="distilbert"), priority=30,
)
