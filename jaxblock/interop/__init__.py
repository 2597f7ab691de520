"""Interoperability with other frameworks.

`jaxblock.interop.torch` converts weights to and from torch.nn.TransformerEncoderLayer /
nn.TransformerEncoder and checks parity sublayer by sublayer. It imports PyTorch (the optional
`[torch]` extra), so it is imported explicitly (`from jaxblock.interop import torch as jt`), never here.
"""
