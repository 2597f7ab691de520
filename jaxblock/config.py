"""Typed, frozen, validated configs for the block, the stack and the encoder.

Shape letters used across the library: N batch, L length, D model width, H query heads,
G key/value heads, K head width (D / H), F FFN inner width, B blocks, C classes, V vocabulary
(the full alphabet: jaxblock/__init__.py and docs/contracts.md).

Every config is a frozen pydantic model that rejects unknown keys. A bad value fails at
construction with a message that names the field and says how to fix it.

Keys are grouped by what they describe:

    EncoderConfig      num_layers, max_len, vocab_size, num_classes, final_norm, scan_layers, remat
      .embedding       EmbeddingConfig: dim, positions, position_offset, type_vocab_size, norm, dropout
      .pooler          PoolerConfig: pooling, dense, activation, bias, norm
      .layers          LayersConfig: per-layer window, rope_base, attn_norm
      .block           BlockConfig: widths, heads, norm placement, activation, dropouts, dtypes, init
        .attention     AttentionConfig: kernel, dropout, chunk_size, causal, rope, projections' biases

Every group has defaults, so `EncoderConfig(block=dict(model_dim=32, attention=dict(dropout=0.1)))` and
`BlockConfig(...)` on its own both work. Keys of the earlier flat layout are refused with the key that
replaced them (`RENAMED`, the one table of old -> new); `migrate_model` rewrites a dumped config of that
layout (a run's saved config.yaml) through the same table.
"""

from __future__ import annotations

from typing import Any, Literal, Self

import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

DTypeName = Literal["float32", "bfloat16", "float16"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# --- the keys of the earlier flat layout --------------------------------------------------------------

# Old key -> new key, both dotted below the encoder config (`model.` in a train config). `pooler` and
# `block.attention` were strings and are groups now: a string value there is the old key. Two values move
# elsewhere: pooler 'auto' / 'dense' / 'none' is dense null / true / false, and positions 'rope' is
# block.attention.rope=true with embedding.positions 'none' (`renamed`).
RENAMED: dict[str, str] = {
    "positions": "embedding.positions",
    "position_offset": "embedding.position_offset",
    "type_vocab_size": "embedding.type_vocab_size",
    "embed_norm": "embedding.norm",
    "embed_dropout": "embedding.dropout",
    "embed_dim": "embedding.dim",
    "pooling": "pooler.pooling",
    "pooler": "pooler.dense",
    "pooler_activation": "pooler.activation",
    "pooler_bias": "pooler.bias",
    "pooler_norm": "pooler.norm",
    "layer_windows": "layers.window",
    "layer_rope_bases": "layers.rope_base",
    "layer_attn_norm": "layers.attn_norm",
    "block.attention": "block.attention.kernel",
    "block.attn_dropout": "block.attention.dropout",
    "block.attn_chunk_size": "block.attention.chunk_size",
    "block.causal": "block.attention.causal",
    "block.rope": "block.attention.rope",
    "block.rope_base": "block.attention.rope_base",
    "block.rope_scaling": "block.attention.rope_scaling",
    "block.qkv_bias": "block.attention.qkv_bias",
    "block.out_bias": "block.attention.out_bias",
    "block.fused_qkv": "block.attention.fused_qkv",
}
_OLD_POOLER = {"auto": None, "dense": True, "none": False}


def renamed(old: str, value: Any) -> list[tuple[str, Any]]:
    """The (new key, value) pairs that old key `old` (dotted below the encoder config) set to `value` means."""
    if old == "positions" and value == "rope":
        return [("embedding.positions", "none"), ("block.attention.rope", True)]
    if old == "pooler" and isinstance(value, str):
        return [("pooler.dense", _OLD_POOLER.get(value, value))]
    return [(RENAMED[old], value)]


def _is_old(old: str, value: Any) -> bool:
    """Whether `old: value` is a key of the earlier layout (`pooler` and `block.attention` are groups now)."""
    return old in RENAMED and not (old in ("pooler", "block.attention") and isinstance(value, dict | BaseModel))


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _replacement(old: str, value: Any, level: str = "") -> str:
    """What replaced old key `old` (dotted below the encoder) set to `value`, dotted below `level`:
    'attention.dropout', or with the value where it changes ('pooler.dense=true')."""
    pairs = [(new.removeprefix(level), v) for new, v in renamed(old, value)]
    moved = len(pairs) > 1 or pairs[0][1] != value
    return " and ".join(f"{k}={_yaml(v)}" if moved else k for k, v in pairs)


def renamed_message(old: str, new: str, prefix: str = "") -> str:
    """The one line refusing an old key: "unknown key 'model.pooling': it is now model.pooler.pooling"."""
    return f"unknown key '{prefix}{old}': it is now " + " and ".join(f"{prefix}{part}" for part in new.split(" and "))


def find_old_key(model: Any) -> tuple[str, str] | None:
    """(old key, its replacement) for the first key of the earlier layout in a dumped encoder config (a
    `model:` section as read from YAML), both dotted below it; None if it has none."""
    if not isinstance(model, dict):
        return None
    block = model.get("block")
    items = [*model.items(), *((f"block.{k}", v) for k, v in (block.items() if isinstance(block, dict) else ()))]
    for key, value in items:
        if isinstance(key, str) and _is_old(key, value):
            return key, _replacement(key, value)
    return None


def _refuse_old_keys(data: Any, level: str, fields: dict[str, Any]) -> None:
    """Raise the one-line 'it is now ...' error for the first key of the earlier layout in `data` (the
    input of the config at `level`: '' for the encoder, 'block.' for a block) whose new home exists there."""
    if not isinstance(data, dict):
        return
    for key, value in data.items():
        old = f"{level}{key}"
        if not isinstance(key, str) or not _is_old(old, value):
            continue
        if renamed(old, value)[0][0].removeprefix(level).split(".")[0] not in fields:
            continue
        new = _replacement(old, value, level)
        raise PydanticCustomError("renamed_key", "unknown key '{old}': it is now {new}", {"old": key, "new": new})


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """tree[a][b][c] = value for dotted 'a.b.c', copying each group on the way (the input stays as it was)."""
    *groups, name = dotted.split(".")
    for group in groups:
        node = tree.get(group)
        tree[group] = dict(node) if isinstance(node, dict) else {}
        tree = tree[group]
    tree[name] = value


def migrate_model(model: dict[str, Any]) -> dict[str, Any]:
    """A dumped encoder config (a `model:` section) with every key of the earlier layout moved to its new
    key (`RENAMED`); a config already in the new layout comes back equal. For reading runs saved before."""
    out = {k: v for k, v in model.items() if not _is_old(k, v)}
    block = model.get("block")
    if isinstance(block, dict):
        out["block"] = {k: v for k, v in block.items() if not _is_old(f"block.{k}", v)}
    moves = [(k, v) for k, v in model.items() if _is_old(k, v)]
    if isinstance(block, dict):
        moves += [(f"block.{k}", v) for k, v in block.items() if _is_old(f"block.{k}", v)]
    for old, value in sorted(moves, key=lambda kv: kv[0] == "positions"):  # rope=true wins over block.rope
        for new, v in renamed(old, value):
            _put(out, new, v)
    return out


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


# --- the block --------------------------------------------------------------------------------------


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


class AttentionConfig(_Frozen):
    """Self-attention inside a block: the kernel, its masks and dropout, rotary positions, the projections."""

    kernel: Literal["auto", "xla", "cudnn", "unfused", "chunked", "dense", "splash", "pallas_gpu"] = Field(
        "auto",
        description="'auto' picks, for the platform the program is lowered for: on a TPU splash attention "
        "(Pallas); on an NVIDIA GPU cuDNN when mask and dtype allow, JAX's Pallas GPU kernel for packed rows, "
        "XLA otherwise; on a CPU the dense kernel (hand-written backward, dropout included), or chunked from 4 "
        "key blocks on; the unfused path whenever attention-weight dropout is active off the CPU. 'splash' and "
        "'pallas_gpu' off their platform run in Pallas interpret mode (checks only: slow).",
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention weights.")
    chunk_size: int = Field(512, gt=0, description="Key-block size of the 'chunked' memory-efficient kernel.")
    causal: bool = Field(False, description="Each query sees only keys at or before it.")
    rope: bool = Field(
        False, description="Rotary positions on q/k in every block (the encoder's embedding.positions is then "
        "'none').",
    )
    rope_base: float = Field(10000.0, gt=1.0, description="RoPE base: the rotary wavelengths' scale.")
    rope_scaling: RopeScaling | None = Field(None, description="None: unscaled rotary frequencies.")
    qkv_bias: bool | None = Field(
        None, description="Biases on the q/k/v projections; None follows block.use_bias (Qwen2: True with "
        "use_bias=False).",
    )
    out_bias: bool | None = Field(None, description="Bias on the out-projection; None follows block.use_bias.")
    fused_qkv: bool = Field(True, description="One matmul for q, k, v when G = H (params stay separate).")


class BlockConfig(_Frozen):
    """One encoder block: self-attention and a position-wise FFN, each in a residual branch."""

    model_dim: int = Field(256, gt=0, description="D: width of every token vector.")
    num_heads: int = Field(4, gt=0, description="H: query heads; D must be divisible by H.")
    num_kv_heads: int | None = Field(
        None, gt=0, description="G: key/value heads (GQA/MQA); None means G = H. H must be divisible by G."
    )
    ffn_dim: int = Field(1024, gt=0, description="F: FFN inner width (D -> F -> D).")
    norm: Literal["pre", "post"] = Field(
        "pre", description="'pre': x + S(LN(x)); 'post': LN(x + S(x))."
    )
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = Field(1e-5, gt=0.0, description="Inside the square root; 1e-5 matches PyTorch.")
    activation: Literal["relu", "gelu", "gelu_tanh", "swiglu", "geglu"] = Field(
        "gelu", description="'gelu' is exact (erf), as PyTorch's; 'gelu_tanh' is the approximation."
    )
    use_bias: bool = Field(True, description="Every bias, the norms' included (PyTorch's `bias`).")
    ffn_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the FFN hidden layer [N, L, F].")
    residual_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on each residual branch's output before the add."
    )
    dtype: DTypeName = Field("float32", description="Compute dtype; softmax and norm statistics stay float32.")
    param_dtype: DTypeName = Field("float32", description="Storage dtype of parameters.")
    init: Literal["flax", "torch"] = Field(
        "flax", description="'torch' reproduces nn.TransformerEncoderLayer's initialization distributions."
    )
    ablate: Literal["none", "attention", "ffn"] = Field(
        "none",
        description="Remove one residual branch entirely (ablation baselines): 'attention' leaves a "
        "bag-of-tokens model in which no token sees another.",
    )
    gradients: Literal["auto", "plain"] = Field(
        "auto",
        description="How the projections, the norms and the FFN are differentiated. 'auto': by the kernels chosen "
        "for the platform (on a CPU, weight gradients that transpose the smaller operand and LayerNorm's backward "
        "written out; on a GPU, the norms, the FFN's activation and the dropout masks recomputed from their inputs "
        "in the backward and each weight gradient computed within its layer: jaxblock/kernels/); 'plain': JAX's "
        "autodiff of the formulas on every platform (forward mode, jax.jvp, needs it).",
    )
    attention: AttentionConfig = Field(default_factory=lambda: AttentionConfig())

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        _refuse_old_keys(data, "block.", cls.model_fields)
        return data

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
        if self.attention.rope and self.head_dim % 2:
            raise ValueError(
                f"attention.rope needs an even head width, got model_dim/num_heads={self.head_dim}: "
                "change num_heads"
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
        return self.use_bias if self.attention.qkv_bias is None else self.attention.qkv_bias

    @property
    def has_out_bias(self) -> bool:
        return self.use_bias if self.attention.out_bias is None else self.attention.out_bias

    @property
    def is_glu(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    def with_kernel(self, kernel: str) -> Self:
        """This config with attention.kernel set to `kernel` (the same parameters)."""
        attention = AttentionConfig.model_validate(self.attention.model_dump() | {"kernel": kernel})
        return self.model_copy(update={"attention": attention})


# --- the stack --------------------------------------------------------------------------------------


class LayersConfig(_Frozen):
    """Per-layer settings: one entry per block (length B), passed to the blocks as scanned inputs, so layers
    that differ in them still share one block definition (scan_layers, remat and every kernel keep working)."""

    window: tuple[int | None, ...] | None = Field(
        None, description="Per-layer sliding attention window: in layer i a query sees only keys at most "
        "window[i] positions away on either side (None entry: every key). None: no window anywhere.",
    )
    rope_base: tuple[float, ...] | None = Field(
        None, description="Per-layer RoPE base (needs block.attention.rope, unscaled); None: "
        "block.attention.rope_base everywhere.",
    )
    attn_norm: tuple[bool, ...] | None = Field(
        None, description="Per-layer: False skips the norm before attention (Pre-LN only; ModernBERT's first "
        "layer reads the embedding norm's output directly). None: every layer has it.",
    )

    @property
    def per_layer(self) -> dict[str, tuple[Any, ...]]:
        """The per-layer settings in force, each a length-B tuple: window (-1 = none), rope_base, attn_norm."""
        out: dict[str, tuple[Any, ...]] = {}
        if self.window is not None and any(w is not None for w in self.window):
            out["window"] = tuple(-1 if w is None else w for w in self.window)
        if self.rope_base is not None:
            out["rope_base"] = self.rope_base
        if self.attn_norm is not None and not all(self.attn_norm):
            out["attn_norm"] = self.attn_norm
        return out

    @property
    def window_choices(self) -> tuple[int, ...]:
        """The distinct per-layer windows (-1 = none), sorted: the static masks a kernel needs when a scanned
        stack hands each layer its window as a traced value."""
        return tuple(sorted(set(self.per_layer.get("window", ()))))


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
    layers: LayersConfig = Field(default_factory=lambda: LayersConfig())

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        _refuse_old_keys(data, "", cls.model_fields)
        return data

    @model_validator(mode="after")
    def _check_per_layer(self) -> StackConfig:
        layers, attention = self.layers, self.block.attention
        for name in LayersConfig.model_fields:
            value = getattr(layers, name)
            if value is not None and len(value) != self.num_layers:
                raise ValueError(
                    f"layers.{name} has {len(value)} entries for num_layers={self.num_layers}: give one per layer"
                )
        if any(w is not None and w < 0 for w in layers.window or ()):
            raise ValueError(f"layers.window={layers.window}: a window is a distance >= 0 (None: no window)")
        if layers.rope_base is not None:
            if not attention.rope:
                raise ValueError("layers.rope_base needs rotary positions: set block.attention.rope=true or remove it")
            if attention.rope_scaling is not None:
                raise ValueError(
                    "layers.rope_base with block.attention.rope_scaling is not supported: remove one of them"
                )
            if any(b <= 1.0 for b in layers.rope_base):
                raise ValueError(f"layers.rope_base={layers.rope_base}: every base must exceed 1")
        if layers.attn_norm is not None and self.block.norm != "pre" and not all(layers.attn_norm):
            raise ValueError("layers.attn_norm can skip a norm only with block.norm='pre': remove it")
        return self

    @property
    def has_final_norm(self) -> bool:
        return self.block.norm == "pre" if self.final_norm is None else self.final_norm

    def with_kernel(self, kernel: str) -> Self:
        """This config with block.attention.kernel set to `kernel` (the same parameters)."""
        return self.model_copy(update={"block": self.block.with_kernel(kernel)})


# --- the encoder ------------------------------------------------------------------------------------


class EmbeddingConfig(_Frozen):
    """Token embedding, token types and additive positions, then the optional norm and dropout."""

    dim: int | None = Field(
        None, gt=0, description="E: width of the embedding tables and embedding norm when it differs from D; "
        "a trained E -> D projection `embed_proj` follows (ELECTRA). None: E = D.",
    )
    positions: Literal["sinusoidal", "learned", "none"] = Field(
        "learned",
        description="Added to the token embedding: 'sinusoidal' a fixed [L, E] table (sin on even, cos on odd "
        "features); 'learned' a trained [max_len, E] table; 'none' nothing (rotary positions, "
        "block.attention.rope, or a permutation-equivariant model).",
    )
    position_offset: int = Field(
        0, ge=0, description="Learned positions start at this table row (RoBERTa: padding_idx + 1); the table "
        "then holds max_len + position_offset rows.",
    )
    type_vocab_size: int = Field(
        0, ge=0, description="Y: token types (BERT's segment A/B); > 0 adds a trained [Y, E] table indexed by "
        "token_type_ids (zeros when not given); 0 = no token types.",
    )
    norm: bool = Field(
        False, description="A norm (block.norm_type, block.norm_eps) on embedding + positions, as BERT's."
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout after embedding + positions (and after the pooler dense)."
    )

    @model_validator(mode="after")
    def _check_offset(self) -> EmbeddingConfig:
        if self.position_offset and self.positions != "learned":
            raise ValueError(f"position_offset={self.position_offset} needs positions='learned': set it to 0")
        return self


class PoolerConfig(_Frozen):
    """How the Classifier reduces a sequence to one vector before its head."""

    pooling: Literal["mean", "cls", "last"] = Field(
        "mean",
        description="'mean' over real tokens; 'cls' the first token (through the D -> D dense, BERT's pooler); "
        "'last' the last real token, head without bias (Llama-family sequence classification).",
    )
    dense: bool | None = Field(
        None, description="The trained D -> D dense and activation before the head; None: with pooling='cls' "
        "only; true: with any pooling (ModernBERT's mean pooling); false: never.",
    )
    activation: Literal["tanh", "relu", "gelu"] = Field(
        "tanh", description="Activation after the dense (tanh: BERT/RoBERTa; relu: DistilBERT; gelu: ELECTRA, "
        "ModernBERT).",
    )
    bias: bool = Field(True, description="Bias on the dense (ModernBERT's classifier_bias).")
    norm: bool = Field(
        False, description="A norm (block.norm_type, block.norm_eps) after the dense's activation (ModernBERT)."
    )

    @model_validator(mode="after")
    def _check_dense(self) -> PoolerConfig:
        if self.dense and self.pooling == "last":
            raise ValueError("dense=true with pooling='last' is not supported: use pooling 'cls' or 'mean'")
        return self

    @property
    def has_dense(self) -> bool:
        """Whether the pooler has its D -> D dense (parameters `pooler`)."""
        return self.pooling == "cls" if self.dense is None else self.dense


class _EncoderSizes(_Frozen):
    # EncoderConfig's own scalar keys: a base class of it only so that they come before the groups in a
    # dumped config (pydantic orders fields base class first).
    max_len: int = Field(128, gt=0, description="Longest sequence the positions support.")
    vocab_size: int = Field(259, gt=0, description="V: token ids lie in [0, V).")
    num_classes: int = Field(2, ge=1, description="C: outputs of the Classifier's head: classes, or 1 for a score.")


class EncoderConfig(StackConfig, _EncoderSizes):
    """Embedding + positions + stack; `num_classes` sizes the Classifier's head."""

    embedding: EmbeddingConfig = Field(default_factory=lambda: EmbeddingConfig())
    pooler: PoolerConfig = Field(default_factory=lambda: PoolerConfig())

    @model_validator(mode="before")
    @classmethod
    def _no_rope_positions(cls, data: Any) -> Any:
        embedding = data.get("embedding") if isinstance(data, dict) else None
        if isinstance(embedding, dict) and embedding.get("positions") == "rope":
            raise PydanticCustomError("renamed_value", "{old}='{value}' is now {new}", {
                "old": "embedding.positions", "value": "rope", "new": _replacement("positions", "rope")})
        return data

    @model_validator(mode="after")
    def _check_rope(self) -> EncoderConfig:
        if self.block.attention.rope and self.embedding.positions != "none":
            raise ValueError(
                f"block.attention.rope=true puts the positions on q/k, but embedding.positions="
                f"'{self.embedding.positions}' adds them too: set embedding.positions=none"
            )
        return self

    @property
    def embed_width(self) -> int:
        """E: the embedding tables' width (embedding.dim, or D)."""
        return self.embedding.dim or self.block.model_dim


def format_validation_error(err: Exception) -> str:
    """One line naming the first offending field and what is wrong with it."""
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    first = errors()[0]
    parts = [str(p) for p in first.get("loc", ())]
    loc = ".".join(parts) or "config"
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") in ("renamed_key", "renamed_value"):
        ctx = first.get("ctx", {})
        prefix = "".join(f"{p}." for p in parts)
        if first["type"] == "renamed_key":
            return renamed_message(str(ctx["old"]), str(ctx["new"]), prefix)
        new = " and ".join(f"{prefix}{part}" for part in str(ctx["new"]).split(" and "))
        return f"{prefix}{ctx['old']}='{ctx['value']}' is now {new}"
    if first.get("type") == "extra_forbidden":
        return f"unknown key '{loc}': remove it or check its spelling"
    if "input" in first and first.get("type") != "value_error":
        return f"{loc}: {msg} (got {first['input']!r})"
    return f"{loc}: {msg}"
