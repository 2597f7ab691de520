"""CamemBERT: RoBERTa's architecture under its own model_type and class names."""

from dataclasses import replace
from functools import partial

from jaxblock.interop.hf import bert_like
from jaxblock.interop.hf.families.roberta import FAMILY as ROBERTA
from jaxblock.interop.hf.family import Family

FAMILY: Family = replace(
    ROBERTA, name="camembert", model_types=("camembert",), hf_class="Camembert",
    defaults=dict(ROBERTA.defaults) | dict(vocab_size=30522),  # CamembertConfig's own default
    hf_config=partial(bert_like.hf_config, layout="roberta", family="camembert", pooler_activation="tanh"),
    matches=None,  # RoBERTa's layout: to_hf writes it only when named
)
