"""Interoperability with other frameworks.

`jaxblock.interop.torch` converts weights to and from torch.nn.TransformerEncoderLayer /
nn.TransformerEncoder and checks parity sublayer by sublayer. It imports PyTorch (the optional
`[torch]` extra), so it is imported explicitly (`from jaxblock.interop import torch as jt`), never here.

`jaxblock.interop.hf` converts HuggingFace `transformers` checkpoints (a registry of families: BERT,
RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA, Llama, Mistral, Qwen2, ModernBERT, and their
sequence-classification heads; docs/families.md) to and from Encoder/Classifier params, with a parity
report. Reading a directory needs only safetensors and tokenizers; to_hf, compare and pytorch_model.bin
files need transformers and torch (the `[hf]` extra): `from jaxblock.interop import hf`.
"""
