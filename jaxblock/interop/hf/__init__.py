"""HuggingFace `transformers` checkpoints <-> jaxblock Encoder / Classifier (optional extra `hf`).

    config, variables = from_hf(model_or_dir)     # EncoderConfig, {"params": ...}
    model = to_hf(config, variables)              # the transformers model, identical state dict
    print(compare(model, tokens, valid_tokens))   # per-layer forward and per-parameter gradient parity
    cfg, params, tokenizer_json, license = load_pretrained(dir)   # what a trainer needs

Families: BERT, RoBERTa, DistilBERT (Post-LN, learned positions, embedding LayerNorm, token types)
and Llama, Mistral, Qwen2 (Pre-RMSNorm, SwiGLU, RoPE, GQA, causal, final norm); their
*ForSequenceClassification heads onto Classifier (pooling 'cls' or 'last'). Anything not expressible
exactly raises UnsupportedConfigError with one line naming the field. A directory is read locally
(config.json + model.safetensors, sharded or not, or pytorch_model.bin): nothing is ever downloaded.

Measured parity (`python -m jaxblock.interop.hf.measure`: random D=64, 2-layer models of each family,
a right-padded batch of 3 x 12), against transformers in float32, worst over the six families:
    ours float32:  last hidden state max |diff| 9.5e-7, logits 9e-8, gradients max rel L2 error 7.6e-7
    ours bfloat16: last hidden state max |diff| 2.5e-2, logits 2.6e-3, gradients max rel L2 error 1.5e-2
`compare` checks against TOLERANCES: float32 (2e-5, 1e-4), bfloat16 (6e-2, 4e-2).

Importing this package imports transformers and torch; importing `jaxblock` does not.
"""

from jaxblock.interop.hf.common import UnsupportedConfigError
from jaxblock.interop.hf.convert import from_hf, guess_family, load_pretrained, state_dict, to_hf
from jaxblock.interop.hf.parity import TOLERANCES, compare

__all__ = ["TOLERANCES", "UnsupportedConfigError", "compare", "from_hf", "guess_family", "load_pretrained",
           "state_dict", "to_hf"]
