"""Interoperability with other frameworks.

`jaxblock.interop.torch` converts weights to and from torch.nn.TransformerEncoderLayer /
nn.TransformerEncoder and checks parity sublayer by sublayer. It imports PyTorch (the optional
`[torch]` extra), so it is imported explicitly (`from jaxblock.interop import torch as jt`), never here.

`jaxblock.interop.hf` converts HuggingFace `transformers` checkpoints (BERT, RoBERTa, DistilBERT, Llama,
Mistral, Qwen2 and their sequence-classification heads) to and from Encoder/Classifier params, with a
parity report. It imports transformers and torch (the `[hf]` extra): `from jaxblock.interop import hf`.
"""
