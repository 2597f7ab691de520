"""Measure parity on tiny random models of every family: `python -m jaxblock.interop.hf.measure`.

Prints, per family and for our float32 and bfloat16 compute against transformers in float32: the max
|diff| of the last hidden state at real positions (and of the classifier logits) and the worst relative
L2 gradient error over all parameters. Models: D=64, 4 heads (Llama family: 2 key/value heads), F=96,
2 layers, V=40, biases and norm weights perturbed off their init; batch 3 x 12, right-padded to
lengths 12, 7, 3, token types 0/1 where the family has them. ELECTRA: embeddings of width 32, projected.
ModernBERT: layer 0 global (RoPE base 1000), layer 1 local (base 50, window +-2: local_attention=4).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

FAMILIES = ("bert", "roberta", "distilbert", "llama", "mistral", "qwen2", "xlm-roberta", "camembert", "electra",
            "modernbert")
VOCAB, PAD, LENGTHS = 40, 1, (12, 7, 3)


def tiny_config(family: str, **extra: Any) -> Any:
    """A small float32 transformers config; extra fields are set on it afterwards."""
    import transformers

    small: dict[str, Any] = dict(
        vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, hidden_size=64
    )
    rope: dict[str, Any] = dict(num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD)
    cfg: Any
    if family == "bert":
        cfg = transformers.BertConfig(**small, pad_token_id=PAD)
    elif family in ("roberta", "xlm-roberta", "camembert"):
        cls = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert"}[family]
        cfg = getattr(transformers, cls + "Config")(**small, max_position_embeddings=40, pad_token_id=PAD)
    elif family == "electra":
        cfg = transformers.ElectraConfig(**small, embedding_size=32, pad_token_id=PAD)
    elif family == "modernbert":
        cfg = transformers.ModernBertConfig(
            **small, layer_types=["full_attention", "sliding_attention"], local_attention=4,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}},
            pad_token_id=PAD, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
    elif family == "distilbert":
        cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=96,
                                            max_position_embeddings=40, pad_token_id=PAD)
    elif family == "llama":
        cfg = transformers.LlamaConfig(**small, **rope, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    elif family == "mistral":
        cfg = transformers.MistralConfig(**small, **rope, sliding_window=None)
    else:
        cfg = transformers.Qwen2Config(**small, **rope)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str, head: bool = False, seed: int = 0, **extra: Any) -> Any:
    """A random transformers model (base without pooler, or *ForSequenceClassification with 3 labels), eval."""
    import torch
    import transformers

    from jaxblock.interop.hf.family import family as registered

    torch.manual_seed(seed)
    fam = registered(family)
    cls = getattr(transformers, fam.hf_class + ("ForSequenceClassification" if head else "Model"))
    cfg = tiny_config(family, **({"num_labels": 3} if head else {}) | extra)
    model = cls(cfg) if head else cls(cfg, **fam.base_kwargs)
    with torch.no_grad():  # init leaves biases 0 and norm weights 1: move them so every map is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def tiny_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens int[3, 12] in [2, V) then PAD, valid bool[3, 12] (right padding), token types int[3, 12]."""
    rng = np.random.default_rng(seed)
    valid = np.arange(12)[None] < np.asarray(LENGTHS)[:, None]
    tokens = np.where(valid, rng.integers(2, VOCAB, (3, 12)), PAD)
    types = ((np.arange(12)[None] >= 4) & valid).astype(np.int64)
    return tokens, valid, types


def main(argv: list[str] | None = None) -> None:
    from jaxblock.interop.hf.parity import compare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    args = parser.parse_args(argv)
    tokens, valid, types = tiny_batch()
    print(f"{'family':<11} {'head':<5} {'dtype':<9} {'max|fwd diff|':>13} {'max rel grad':>13}")
    for family in args.families:
        for head in (False, True):
            model = tiny_model(family, head)
            for dtype in ("float32", "bfloat16"):
                report = compare(model, tokens, valid, token_type_ids=types, dtype=dtype)
                fwd = max(c.value for c in report.checks if c.name == "output")
                grad = max(c.value for c in report.checks if c.kind == "grad")
                print(f"{family:<11} {'yes' if head else 'no':<5} {dtype:<9} {fwd:13.2e} {grad:13.2e}", flush=True)


if __name__ == "__main__":
    main()
