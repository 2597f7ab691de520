"""jaxblock: one Transformer encoder block, done carefully, as pure Flax Linen modules.

Shapes: N batch, L length, D width, H heads, K = D / H head width, F FFN width, C classes.
Mask convention: `valid_tokens: bool[N, L]`, True = a real token (real tokens first).
"""

from flax.linen import unbox

from jaxblock.attention import SelfAttention, choose_implementation
from jaxblock.block import EncoderBlock
from jaxblock.config import BlockConfig, EncoderConfig, StackConfig
from jaxblock.ffn import FeedForward
from jaxblock.model import (
    Classifier,
    Encoder,
    EncoderStack,
    masked_mean,
    segment_mean,
    stack_layer_params,
    unstack_layer_params,
)
from jaxblock.norms import LayerNorm, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "BlockConfig",
    "Classifier",
    "Encoder",
    "EncoderBlock",
    "EncoderConfig",
    "EncoderStack",
    "FeedForward",
    "LayerNorm",
    "RMSNorm",
    "SelfAttention",
    "StackConfig",
    "__version__",
    "choose_implementation",
    "masked_mean",
    "segment_mean",
    "stack_layer_params",
    "unbox",
    "unstack_layer_params",
]
