"""Typed, frozen, validated configs for the block, the stack and the encoder.

Shape letters used across the library: N batch, L length, D model width, H query heads,
G key/value heads, K head width (D / H), F FFN inner width, B blocks, C classes, V vocabulary
(the full alphabet: jaxblock/__init__.py and docs/contracts.md).

Every config is a frozen pydantic model that rejects unknown keys. A bad value fails at
construction with a message that names the field and says how to fix it.
"""

from __future__ import annotations

from typing import Any, Literal

import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

DTypeName = Literal["float32", "bfloat16", "float16"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class RopeScaling(_Frozen):
    """RoPE frequency scaling (transformers' rope_type): 'linear' divides every frequency by `factor`;
    'llama3' divides frequencies whose wavelength exceeds original_max_len / low_freq_factor by `factor`,
    keeps those shorter than original_max_len / high_freq_factor, and interpolates in between (Llama 3.1+)."""

    type: Literal["linear", "llama3"]
    factor: float = Field(gt=0.0)
    low_freq_factor: float = Field(1.0, gt=0.0)
    high_freq_factor: float = Field(4.0, gt=0.0)
    original_max_len: int = Field(8192, gt=0, description="Context length the model was trained with.")

    @model_validator(mode="after")
    def _check_band(self) -> RopeScaling:
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor={self.high_freq_factor} must exceed low_freq_factor={self.low_freq_factor}"
            )
        return self


class BlockConfig(_Frozen):
    """One encoder block: self-attention and a position-wise FFN, each in a residual branch."""

    model_dim: int = Field(256, gt=0, description="D: width of every token vector.")
    num_heads: int = Field(4, gt=0, description="H: query heads; D must be divisible by H.")
    num_kv_heads: int | None = Field(
        None, gt=0, description="G: key/value heads (GQA/MQA); None means G = H. H must be divisible by G."
    )
    ffn_dim: int = Field(1024, gt=0, description="F: FFN inner width (D -> F -> D).")
    attn_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention weights.")
    ffn_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the FFN hidden layer [N, L, F].")
    residual_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on each residual branch's output before the add."
    )
    norm: Literal["pre", "post"] = Field(
        "pre", description="'pre': x + S(LN(x)); 'post': LN(x + S(x))."
    )
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = Field(1e-5, gt=0.0, description="Inside the square root; 1e-5 matches PyTorch.")
    activation: Literal["relu", "gelu", "gelu_tanh", "swiglu", "geglu"] = Field(
        "gelu", description="'gelu' is exact (erf), as PyTorch's; 'gelu_tanh' is the approximation."
    )
    use_bias: bool = Field(True, description="Every bias, the norms' included (PyTorch's `bias`).")
    qkv_bias: bool | None = Field(
        None, description="Biases on the q/k/v projections; None follows use_bias (Qwen2: True with use_bias=False)."
    )
    out_bias: bool | None = Field(None, description="Bias on the attention out-projection; None follows use_bias.")
    causal: bool = Field(False, description="Each query sees only keys at or before it.")
    rope: bool = Field(False, description="Rotary positions on q/k (set by EncoderConfig.positions='rope').")
    rope_base: float = Field(10000.0, gt=1.0)
    rope_scaling: RopeScaling | None = Field(None, description="None: unscaled rotary frequencies.")
    attention: Literal["auto", "xla", "cudnn", "unfused", "chunked", "dense", "splash", "pallas_gpu"] = Field(
        "auto",
        description="Kernel: 'auto' picks, for the platform the program is lowered for: on a TPU splash attention "
        "(Pallas); on an NVIDIA GPU cuDNN when mask and dtype allow, JAX's Pallas GPU kernel for packed rows, "
        "XLA otherwise; on a CPU the dense kernel (hand-written backward, dropout included), or chunked from 4 "
        "key blocks on; the unfused path whenever attention-weight dropout is active off the CPU. 'splash' and "
        "'pallas_gpu' off their platform run in Pallas interpret mode (checks only: slow).",
    )
    attn_chunk_size: int = Field(
        512, gt=0, description="Key-block size of the 'chunked' memory-efficient attention."
    )
    ablate: Literal["none", "attention", "ffn"] = Field(
        "none",
        description="Remove one residual branch entirely (ablation baselines): 'attention' leaves a "
        "bag-of-tokens model in which no token sees another.",
    )
    fused_qkv: bool = Field(True, description="One matmul for q, k, v when G = H (params stay separate).")
    dtype: DTypeName = Field("float32", description="Compute dtype; softmax and norm statistics stay float32.")
    param_dtype: DTypeName = Field("float32", description="Storage dtype of parameters.")
    init: Literal["flax", "torch"] = Field(
        "flax", description="'torch' reproduces nn.TransformerEncoderLayer's initialization distributions."
    )

    @model_validator(mode="after")
    def _check_shapes(self) -> BlockConfig:
        if self.model_dim % self.num_heads:
            raise ValueError(
                f"model_dim={self.model_dim} is not divisible by num_heads={self.num_heads}: "
                "pick num_heads that divides model_dim"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}: "
                "pick a divisor of num_heads (1 for MQA) or leave it unset"
            )
        if self.rope and self.head_dim % 2:
            raise ValueError(
                f"rope needs an even head width, got model_dim/num_heads={self.head_dim}: change num_heads"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def compute_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def params_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def has_qkv_bias(self) -> bool:
        return self.use_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def has_out_bias(self) -> bool:
        return self.use_bias if self.out_bias is None else self.out_bias

    @property
    def is_glu(self) -> bool:
        return self.activation in ("swiglu", "geglu")


class StackConfig(_Frozen):
    """B blocks and the final norm: what PyTorch's nn.TransformerEncoder is."""

    num_layers: int = Field(4, gt=0, description="B: number of blocks.")
    final_norm: bool | None = Field(
        None, description="Norm after the last block; None follows the placement (pre: yes, post: no)."
    )
    scan_layers: bool = Field(False, description="nn.scan over blocks: params stacked on a 'layers' axis.")
    remat: Literal["none", "full", "dots"] = Field(
        "none", description="Rematerialize each block: 'full' saves nothing, 'dots' saves matmul outputs."
    )
    block: BlockConfig = Field(default_factory=lambda: BlockConfig())
    # Per-layer settings: one entry per block (length B), passed to the blocks as scanned inputs, so layers
    # that differ in them still share one block definition (scan_layers, remat and every kernel keep working).
    layer_windows: tuple[int | None, ...] | None = Field(
        None, description="Per-layer sliding attention window: in layer i a query sees only keys at most "
        "layer_windows[i] positions away on either side (None entry: every key). None: no window anywhere.",
    )
    layer_rope_bases: tuple[float, ...] | None = Field(
        None, description="Per-layer RoPE base (needs rotary positions, unscaled); None: block.rope_base everywhere.",
    )
    layer_attn_norm: tuple[bool, ...] | None = Field(
        None, description="Per-layer: False skips the norm before attention (Pre-LN only; ModernBERT's first "
        "layer reads the embedding norm's output directly). None: every layer has it.",
    )

    @model_validator(mode="after")
    def _check_per_layer(self) -> StackConfig:
        for name in ("layer_windows", "layer_rope_bases", "layer_attn_norm"):
            value = getattr(self, name)
            if value is not None and len(value) != self.num_layers:
                raise ValueError(
                    f"{name} has {len(value)} entries for num_layers={self.num_layers}: give one per layer"
                )
        if any(w is not None and w < 0 for w in self.layer_windows or ()):
            raise ValueError(f"layer_windows={self.layer_windows}: a window is a distance >= 0 (None: no window)")
        if self.layer_rope_bases is not None:
            if not self.block.rope:
                raise ValueError("layer_rope_bases needs rotary positions: set positions='rope' or remove it")
            if self.block.rope_scaling is not None:
                raise ValueError("layer_rope_bases with block.rope_scaling is not supported: remove one of them")
            if any(b <= 1.0 for b in self.layer_rope_bases):
                raise ValueError(f"layer_rope_bases={self.layer_rope_bases}: every base must exceed 1")
        if self.layer_attn_norm is not None and self.block.norm != "pre" and not all(self.layer_attn_norm):
            raise ValueError("layer_attn_norm can skip a norm only with block.norm='pre': remove it")
        return self

    @property
    def has_final_norm(self) -> bool:
        return self.block.norm == "pre" if self.final_norm is None else self.final_norm

    @property
    def per_layer(self) -> dict[str, tuple[Any, ...]]:
        """The per-layer settings in force, each a length-B tuple: window (-1 = none), rope_base, attn_norm."""
        out: dict[str, tuple[Any, ...]] = {}
        if self.layer_windows is not None and any(w is not None for w in self.layer_windows):
            out["window"] = tuple(-1 if w is None else w for w in self.layer_windows)
        if self.layer_rope_bases is not None:
            out["rope_base"] = self.layer_rope_bases
        if self.layer_attn_norm is not None and not all(self.layer_attn_norm):
            out["attn_norm"] = self.layer_attn_norm
        return out

    @property
    def window_choices(self) -> tuple[int, ...]:
        """The distinct per-layer windows (-1 = none), sorted: the static masks a kernel needs when a scanned
        stack hands each layer its window as a traced value."""
        return tuple(sorted(set(self.per_layer.get("window", ()))))


class EncoderConfig(StackConfig):
    """Embedding + positions + stack; `num_classes` sizes the Classifier's head."""

    vocab_size: int = Field(259, gt=0, description="V: token ids lie in [0, V).")
    max_len: int = Field(128, gt=0, description="Longest sequence the positions support.")
    positions: Literal["sinusoidal", "learned", "rope", "none"] = Field(
        "learned",
        description="'sinusoidal': fixed [L, D] table (sin on even, cos on odd features) added to the "
        "embedding; 'learned': a trained [max_len, D] table added; 'rope': rotary on q/k in every block; "
        "'none': permutation-equivariant.",
    )
    position_offset: int = Field(
        0, ge=0, description="Learned positions start at this table row (RoBERTa: padding_idx + 1); the table "
        "then holds max_len + position_offset rows.",
    )
    type_vocab_size: int = Field(
        0, ge=0, description="Y: token types (BERT's segment A/B); > 0 adds a trained [Y, D] table indexed by "
        "token_type_ids (zeros when not given); 0 = no token types.",
    )
    embed_norm: bool = Field(
        False, description="A norm (block.norm_type, block.norm_eps) on embedding + positions, as BERT's."
    )
    embed_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout after embedding + positions.")
    num_classes: int = Field(2, ge=1, description="C: outputs of the Classifier's head: classes, or 1 for a score.")
    pooling: Literal["mean", "cls", "last"] = Field(
        "mean",
        description="Classifier pooling: 'mean' over real tokens; 'cls' the first token through a trained "
        "D -> D pooler dense and pooler_activation (BERT's pooler); 'last' the last real token, head without "
        "bias (Llama-family sequence classification).",
    )
    pooler_activation: Literal["tanh", "relu", "gelu"] = Field(
        "tanh", description="Activation of the pooler (tanh: BERT/RoBERTa; relu: DistilBERT; gelu: ELECTRA, "
        "ModernBERT).",
    )
    pooler: Literal["auto", "dense", "none"] = Field(
        "auto", description="The D -> D pooler dense before the head: 'auto' with pooling='cls' only; 'dense' "
        "with any pooling (ModernBERT's mean pooling); 'none' never.",
    )
    pooler_bias: bool = Field(True, description="Bias on the pooler dense (ModernBERT's classifier_bias).")
    pooler_norm: bool = Field(
        False, description="A norm (block.norm_type, block.norm_eps) after the pooler's activation (ModernBERT)."
    )
    embed_dim: int | None = Field(
        None, gt=0, description="E: width of the embedding tables and embedding norm when it differs from D; "
        "a trained E -> D projection `embed_proj` follows (ELECTRA). None: E = D.",
    )

    @model_validator(mode="before")
    @classmethod
    def _rope_follows_positions(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("positions") == "rope":
            block = data.get("block", {})
            if isinstance(block, BlockConfig):
                block = block.model_copy(update={"rope": True})
            elif isinstance(block, dict):
                block = {**block, "rope": True}
            data = {**data, "block": block}
        return data

    @model_validator(mode="after")
    def _check_rope(self) -> EncoderConfig:
        if self.block.rope and self.positions != "rope":
            raise ValueError(
                f"block.rope=True but positions='{self.positions}': set positions='rope' instead"
            )
        if self.pooler == "dense" and self.pooling == "last":
            raise ValueError("pooler='dense' with pooling='last' is not supported: use pooling 'cls' or 'mean'")
        if self.position_offset and self.positions != "learned":
            raise ValueError(
                f"position_offset={self.position_offset} needs positions='learned': set it to 0"
            )
        return self

    @property
    def has_pooler(self) -> bool:
        return self.pooler == "dense" or (self.pooler == "auto" and self.pooling == "cls")

    @property
    def embed_width(self) -> int:
        return self.embed_dim or self.block.model_dim


def format_validation_error(err: Exception) -> str:
    """One line naming the first offending field and what is wrong with it."""
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    first = errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ())) or "config"
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        return f"unknown key '{loc}': remove it or check its spelling"
    if "input" in first and first.get("type") != "value_error":
        return f"{loc}: {msg} (got {first['input']!r})"
    return f"{loc}: {msg}"
