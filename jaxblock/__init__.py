"""jaxblock: one Transformer encoder block, done carefully, as pure Flax Linen modules.

Shape alphabet (one meaning per letter, used in docstrings, einsums and tests; docs/contracts.md):
N batch rows, L sequence length, D model width, H query heads, G key/value heads, R = H / G,
K = D / H head width, F FFN inner width, B blocks (layers), V vocabulary, C classes,
S segments (packed examples) per row, T real tokens of a batch, P predicted positions per row
(MLM), Y token types, E examples of a split, and inside attention einsums
Q / M query / key positions (each of length L) and J a key block of the chunked kernel.
Mask convention: `valid_tokens: bool[N, L]`, True = a real token (real tokens first).
"""

from flax.linen import unbox

from jaxblock.attention import SelfAttention, choose_implementation
from jaxblock.block import EncoderBlock
from jaxblock.config import BlockConfig, EncoderConfig, StackConfig
from jaxblock.ffn import FeedForward
from jaxblock.mlm import MaskedLM, mlm_loss, select_positions
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
    "MaskedLM",
    "RMSNorm",
    "SelfAttention",
    "StackConfig",
    "__version__",
    "choose_implementation",
    "masked_mean",
    "mlm_loss",
    "segment_mean",
    "select_positions",
    "stack_layer_params",
    "unbox",
    "unstack_layer_params",
]
