"""EncoderStack (B blocks + final norm), Encoder (embedding + positions + stack), pooling, Classifier.

Parameter tree (unrolled): stack/layers_0 ... layers_{B-1}/{attn_norm, self_attn/{query,key,value,out},
ffn_norm, ffn/{linear1, [gate,] linear2}}, stack/final_norm. With `scan_layers` the blocks live under
stack/layers with a leading [B] axis (logical name 'layers'); `stack_layer_params` and
`unstack_layer_params` convert between the two trees.
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock import masks
from jaxblock.attention.platform import mesh_layout
from jaxblock.block import TOKENS, EncoderBlock
from jaxblock.config import EncoderConfig, StackConfig
from jaxblock.ffn import gelu_exact
from jaxblock.initializers import logical
from jaxblock.kernels.dropout import Dropout
from jaxblock.norms import make_norm
from jaxblock.positions import sinusoidal_table

# Remat lowers peak memory only together with scan_layers on XLA's CPU backend: with unrolled layers
# its scheduler runs the recomputed forward early, so the step recomputes and keeps as much live
# (measured: N=4 L=512 D=256 B=4 step plans 436 MiB with or without remat; scan + remat full 166 MiB).
_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_saveable,
}


class _Layer(EncoderBlock):
    """EncoderBlock with positional-only arguments, as nn.scan and nn.remat require."""

    train: bool = False
    scanned: bool = False
    settings: tuple[tuple[str, Any], ...] = ()  # an unrolled layer's row, as Python values known while tracing

    def __call__(  # type: ignore[override]
        self, x: jax.Array, valid_tokens: jax.Array, attn_mask: Any, segment_ids: Any, positions: Any,
        per_layer: Any,
    ) -> Any:
        per_layer = dict(self.settings) or per_layer
        y = super().__call__(
            x, valid_tokens, attn_mask=attn_mask, segment_ids=segment_ids, positions=positions,
            per_layer=per_layer, train=self.train,
        )
        return (y, None) if self.scanned else y


class EncoderStack(nn.Module):
    """(x [N, L, D], valid_tokens bool[N, L]) -> [N, L, D]: B blocks, then the final norm if any."""

    config: StackConfig

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        valid_tokens: jax.Array,
        *,
        attn_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        cfg = self.config
        chex.assert_rank(x, 3)
        masks.check_valid_tokens(valid_tokens, x.shape[:2])
        layer: Any = _Layer
        if cfg.remat != "none":
            layer = nn.remat(layer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        args = (valid_tokens, attn_mask, segment_ids, positions)
        # Per-layer settings: scanned, arrays with a leading [B] axis; unrolled, layer i gets row i as constants
        # (so that a global layer among windowed ones is known to be global, and gets a kernel without windows).
        per_layer = {k: jnp.asarray(v) for k, v in cfg.layers.per_layer.items()} or None
        if cfg.scan_layers:
            scanned = nn.scan(
                layer,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast,) * 4 + (0 if per_layer else nn.broadcast,),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            block = scanned(cfg.block, cfg.layers.window_choices, train=train, scanned=True, name="layers")
            x, _ = block(x, *args, per_layer)
        else:
            for i in range(cfg.num_layers):
                row = tuple((k, v[i]) for k, v in cfg.layers.per_layer.items())
                x = layer(cfg.block, cfg.layers.window_choices, train=train, settings=row, name=f"layers_{i}")(
                    x, *args, None)
        if cfg.has_final_norm:
            x = make_norm(cfg.block, "final_norm")(x)
        return x


class Encoder(nn.Module):
    """(tokens int[N, L], valid_tokens bool[N, L]) -> [N, L, D]: embedding + positions + stack.

    token_type_ids int[N, L] in [0, Y) (zeros when None) are read only when config.embedding.type_vocab_size = Y > 0.
    """

    config: EncoderConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        valid_tokens: jax.Array,
        *,
        token_type_ids: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        attn_mask: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        cfg = self.config
        blk = cfg.block
        chex.assert_rank(tokens, 2)
        masks.check_valid_tokens(valid_tokens, tokens.shape)
        n, length = tokens.shape
        if length > cfg.max_len:
            raise ValueError(
                f"sequence length {length} exceeds max_len={cfg.max_len}: truncate inputs or raise model.max_len"
            )
        width = cfg.embed_width  # E: D unless the embeddings are narrower (then projected to D)
        embed = self.param(
            "embedding",
            logical(nn.initializers.normal(1.0), ("vocab", "embed")),
            (cfg.vocab_size, width), blk.params_dtype,
        )
        # A padded id outside [0, V) looks up id 0 (not NaN), so the lookup and its gradient stay finite.
        in_range = (tokens >= 0) & (tokens < cfg.vocab_size)
        table = embed
        layout = mesh_layout()
        if layout is not None and layout.embed:
            # FSDP: looked up from the table gathered on its model axis, as every weight is used, instead of the
            # looked-up rows coming out split on it and being resharded (an all-to-all each way). Only then: the
            # constraint also reduces the table's gradient where it stands, which on a replicated table is an
            # early all-reduce of its own.
            table = nn.with_logical_constraint(embed, ("vocab", "act_embed"))
        x = jnp.take(table, jnp.where(valid_tokens | in_range, tokens, 0), axis=0).astype(jnp.float32)  # [N, L, D]
        if cfg.embedding.type_vocab_size:
            types = self.param(
                "type_embedding",
                logical(nn.initializers.normal(0.02), (None, "embed")),
                (cfg.embedding.type_vocab_size, width), blk.params_dtype,
            )  # [Y, E]
            type_ids = jnp.zeros_like(tokens) if token_type_ids is None else token_type_ids
            chex.assert_equal_shape([type_ids, tokens])
            x = x + jnp.take(types, type_ids, axis=0).astype(jnp.float32)
        if segment_ids is not None:
            positions = masks.segment_positions(segment_ids)
        else:
            positions = jnp.broadcast_to(jnp.arange(length), (n, length))
        if cfg.embedding.positions == "sinusoidal":
            x = x + sinusoidal_table(cfg.max_len, width)[positions]
        elif cfg.embedding.positions == "learned":
            table = self.param(
                "pos_embedding",
                logical(nn.initializers.normal(0.02), (None, "embed")),
                (cfg.max_len + cfg.embedding.position_offset, width), blk.params_dtype,
            )
            x = x + table.astype(jnp.float32)[positions + cfg.embedding.position_offset]
        if cfg.embedding.norm:
            # Summed in float32, normalized from the compute dtype as a block's norms are: the norm keeps its
            # input for the backward pass, and in float32 that is twice the bytes of any other [N, L, E] kept.
            x = make_norm(blk.model_copy(update={"model_dim": width}), "embed_norm")(x.astype(blk.compute_dtype))
        x = Dropout(cfg.embedding.dropout, gradients=blk.gradients)(x, deterministic=not train)
        if width != blk.model_dim:  # E -> D (ELECTRA's embeddings_project)
            x = nn.Dense(
                blk.model_dim,
                kernel_init=logical(nn.initializers.lecun_normal(), (None, "embed")),
                bias_init=logical(nn.initializers.zeros_init(), ("embed",)),
                param_dtype=blk.params_dtype, dtype=jnp.float32, name="embed_proj",
            )(x)
        x = nn.with_logical_constraint(x.astype(blk.compute_dtype), TOKENS)
        return EncoderStack(cfg, name="stack")(
            x, valid_tokens, attn_mask=attn_mask, segment_ids=segment_ids,
            positions=positions if blk.attention.rope else None, train=train,
        )


def masked_mean(x: jax.Array, valid_tokens: jax.Array) -> jax.Array:
    """[N, L, D] -> float32[N, D]: mean over real tokens only (a row with none gives 0)."""
    masks.check_valid_tokens(valid_tokens, x.shape[:2])
    keep = valid_tokens[..., None]  # [N, L, 1]
    # where, not multiply: a non-finite padded output must not reach the mean (0 * NaN = NaN).
    total = jnp.sum(jnp.where(keep, x.astype(jnp.float32), 0.0), axis=1)
    return total / jnp.maximum(jnp.sum(keep.astype(jnp.float32), axis=1), 1.0)


def segment_mean(x: jax.Array, valid_tokens: jax.Array, segment_ids: jax.Array, num_segments: int) -> jax.Array:
    """Packed rows: [N, L, D] -> float32[N, S, D], mean of each segment's real tokens (ids 0..S-1)."""
    slots = jnp.arange(num_segments)[None, None, :]
    w = ((segment_ids[..., None] == slots) & valid_tokens[..., None]).astype(jnp.float32)  # [N, L, S]
    real = jnp.where(valid_tokens[..., None], x.astype(jnp.float32), 0.0)  # keep NaN padding out
    total = jnp.einsum("NLS,NLD->NSD", w, real)
    return total / jnp.maximum(jnp.sum(w, axis=1), 1.0)[..., None]


def last_token(x: jax.Array, valid_tokens: jax.Array) -> jax.Array:
    """[N, L, D] -> float32[N, D]: each row's last real token (real tokens first; a row with none gives row 0)."""
    last = jnp.maximum(jnp.sum(valid_tokens, axis=1, dtype=jnp.int32) - 1, 0)  # [N]
    return jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)


def pool_tokens(pooling: str, x: jax.Array, valid_tokens: jax.Array) -> jax.Array:
    """[N, L, D] -> float32[N, D] as the Classifier pools before its head: 'cls' token 0, 'last' the last real
    token, 'mean' the mean over real tokens."""
    if pooling == "cls":
        return x[:, 0].astype(jnp.float32)
    if pooling == "last":
        return last_token(x, valid_tokens)
    return masked_mean(x, valid_tokens)


_POOLER_ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu, "gelu": gelu_exact}


class Classifier(nn.Module):
    """(tokens, valid_tokens, train=False) -> float32 logits [N, C] via config.pooler.

    'mean': masked mean -> head (kernel [D, C], bias [C]). 'cls': token 0 -> pooler (Dense D -> D,
    tanh, relu or gelu, then its norm if pooler.norm) -> dropout (embedding.dropout) -> head. 'last': the last real
    token -> head without bias. pooler.dense=true puts the pooler after mean pooling too (ModernBERT).
    Packed rows ('mean' only): pass segment_ids (ids 0..S-1 per row) and num_segments=S to get [N, S, C].
    """

    config: EncoderConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        valid_tokens: jax.Array,
        *,
        segment_ids: jax.Array | None = None,
        num_segments: int | None = None,
        token_type_ids: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        cfg = self.config
        h = Encoder(cfg, name="encoder")(
            tokens, valid_tokens, token_type_ids=token_type_ids, segment_ids=segment_ids, train=train
        )
        if segment_ids is not None and num_segments is not None:
            if cfg.pooler.pooling != "mean":
                raise ValueError(f"packed rows need pooler.pooling='mean', not '{cfg.pooler.pooling}': unpack them")
            pooled = segment_mean(h, valid_tokens, segment_ids, num_segments)  # [N, S, D]
        else:
            pooled = pool_tokens(cfg.pooler.pooling, h, valid_tokens)  # [N, D]
        # Rows split, the model axis whole, as the encoder's output is: under FSDP the head's weights are gathered.
        pooled = nn.with_logical_constraint(pooled, ("batch", *(None,) * (pooled.ndim - 2), "act_embed"))
        if cfg.pooler.has_dense:
            pooled = nn.Dense(
                cfg.block.model_dim,
                use_bias=cfg.pooler.bias,
                kernel_init=logical(nn.initializers.lecun_normal(), ("embed", None)),
                bias_init=logical(nn.initializers.zeros_init(), (None,)),
                param_dtype=cfg.block.params_dtype,
                dtype=jnp.float32,
                name="pooler",
            )(pooled)
            pooled = _POOLER_ACTIVATIONS[cfg.pooler.activation](pooled)
            if cfg.pooler.norm:
                f32_block = cfg.block.model_copy(update={"dtype": "float32"})
                pooled = make_norm(f32_block, "pooler_norm")(pooled)
            pooled = Dropout(cfg.embedding.dropout, gradients=cfg.block.gradients)(pooled, deterministic=not train)
        head = nn.Dense(
            cfg.num_classes,
            use_bias=cfg.pooler.pooling != "last",
            kernel_init=logical(nn.initializers.lecun_normal(), ("embed", None)),
            bias_init=logical(nn.initializers.zeros_init(), (None,)),
            param_dtype=cfg.block.params_dtype,
            dtype=jnp.float32,
            name="head",
        )
        logits = head(pooled)
        chex.assert_type(logits, jnp.float32)
        return logits


# --- stacked <-> per-layer parameter trees -----------------------------------------------------


def stack_layer_params(tree: Any) -> Any:
    """Per-layer tree (layers_0..layers_{B-1}) -> scanned tree (layers with a leading [B] axis).

    Works on any (unboxed) variables dict; every dict holding layers_i keys is converted.
    """
    if not isinstance(tree, dict):
        return tree
    keys = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k.split("_")[1]))
    out = {k: stack_layer_params(v) for k, v in tree.items() if k not in keys}
    if keys:
        out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[k] for k in keys])
    return out


def unstack_layer_params(tree: Any) -> Any:
    """Scanned tree (layers with a leading [B] axis) -> per-layer tree (layers_0..layers_{B-1})."""
    if not isinstance(tree, dict):
        return tree
    out = {k: unstack_layer_params(v) for k, v in tree.items() if k != "layers"}
    if "layers" in tree:
        num = jax.tree.leaves(tree["layers"])[0].shape[0]
        for i in range(num):
            out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], tree["layers"])
    return out
