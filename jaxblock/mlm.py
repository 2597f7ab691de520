"""Masked-language-model head over `Encoder`: logits for chosen positions, tied or untied output.

Shapes: N batch, L length, D width, P predicted positions per row, V vocabulary.
Mask convention: `valid_tokens: bool[N, L]`, True = a real token (real tokens first); `weights: bool[N, P]`,
True = a chosen position whose loss counts (False = a filler slot, e.g. past a row's last choice).

Parameter tree: encoder/... (exactly `Encoder`'s, so a fine-tune loads it unchanged), transform_dense
and transform_norm when `transform`, output_bias [V], and output_kernel [D, V] only when untied.

Why the tied logits are scaled by 1/sqrt(D): `Encoder` initialises the embedding N(0, 1) (the input
scale a Pre-LN stack wants), while the final norm leaves hidden states at unit variance per feature, so
h . e has standard deviation sqrt(D) (11 at D=128): softmax starts saturated on a few random words and
the loss starts near sqrt(D) nats instead of ln V. Scaling by 1/sqrt(D) starts the logits at unit scale,
as an untied LeCun-initialised kernel does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxblock.config import EncoderConfig
from jaxblock.initializers import logical
from jaxblock.model import Encoder
from jaxblock.norms import make_norm

Metrics = dict[str, jax.Array]


def select_positions(chosen: jax.Array, max_predictions: int) -> tuple[jax.Array, jax.Array]:
    """bool[N, L] chosen tokens -> (positions int32[N, P], weights bool[N, P]) with P = max_predictions.

    Chosen positions come first in increasing order; the rest of each row is filled with position 0
    and weight False. A row with more than P chosen tokens keeps its first P (pick P >= the most a row
    can hold, e.g. ceil(rate * L) + a margin, so nothing is dropped). Jit-friendly: P is static.
    """
    chex.assert_rank(chosen, 2)
    if not 0 < max_predictions <= chosen.shape[1]:
        raise ValueError(f"max_predictions={max_predictions} must be in 1..L={chosen.shape[1]}")
    order = jnp.argsort(~chosen, axis=1, stable=True)[:, :max_predictions]  # chosen first, in order
    weights = jnp.take_along_axis(chosen, order, axis=1)
    positions = jnp.where(weights, order, 0).astype(jnp.int32)
    return positions, weights


class MaskedLM(nn.Module):
    """(tokens int[N, L], valid_tokens bool[N, L]) -> float32 logits [N, L, V], or [N, P, V] at `positions`.

    Pass `positions` (int[N, P], from `select_positions`) in training: the output projection is the
    costliest matmul of a small encoder (N*L*D*V: at D=128, V=16k it is 64x one D x D projection), and
    its float32 logits with their gradient hold 2*N*L*V*4 bytes (512 MiB at N=128, L=64); gathering
    the ~15% chosen positions first cuts both by L/P.

    tie_embeddings: output kernel = the encoder's token embedding (transposed), logits scaled by
      1/sqrt(D) (see the module docstring); False: its own [D, V] kernel.
    transform: BERT's prediction transform (dense D->D, GELU, norm) before the projection; it gives the
      MLM objective its own layer, so the encoder's last block need not serve as a word predictor.
    Padding never influences a real position (attention masks it) and `mlm_loss` ignores filler slots.

    With `targets` (int[N, P], the original ids at `positions`) it returns (losses float32[N, P], predicted
    int32[N, P]) instead of the logits: `chunked_cross_entropy` in `chunks` groups of slots, the logits made
    again in the backward pass rather than kept for it (what a training step needs, in less memory).
    """

    config: EncoderConfig
    tie_embeddings: bool = True
    transform: bool = True

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        valid_tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        train: bool = False,
        targets: jax.Array | None = None,
        chunks: int = 1,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        cfg = self.config
        blk = cfg.block
        encoder = Encoder(cfg, name="encoder")
        h = encoder(tokens, valid_tokens, segment_ids=segment_ids, train=train)  # [N, L, D]
        if positions is not None:
            chex.assert_rank(positions, 2)
            chex.assert_equal(positions.shape[0], tokens.shape[0])
            h = jnp.take_along_axis(h, positions[..., None].astype(jnp.int32), axis=1)  # [N, P, D]
            h = nn.with_logical_constraint(h, ("batch", None, "act_embed"))
        dim = blk.model_dim
        if self.transform:
            h = nn.Dense(
                dim,
                kernel_init=logical(nn.initializers.lecun_normal(), ("embed", "mlp")),
                bias_init=logical(nn.initializers.zeros_init(), ("mlp",)),
                param_dtype=blk.params_dtype, dtype=blk.compute_dtype, name="transform_dense",
            )(h)
            h = nn.gelu(h, approximate=False)
            h = make_norm(blk, "transform_norm")(h)
        h = h.astype(blk.compute_dtype)
        if self.tie_embeddings:
            embedding = nn.unbox(encoder.variables["params"]["embedding"])  # [V, D]
            kernel, spec, scale = embedding, "NPD,VD->NPV", 1.0 / math.sqrt(dim)
        else:
            kernel = self.param(
                "output_kernel",
                logical(nn.initializers.lecun_normal(), ("embed", "vocab")),
                (dim, cfg.vocab_size), blk.params_dtype,
            )
            kernel, spec, scale = jnp.asarray(kernel), "NPD,DV->NPV", 1.0
        bias = self.param(
            "output_bias", logical(nn.initializers.zeros_init(), ("vocab",)),
            (cfg.vocab_size,), blk.params_dtype,
        )

        # The kernel is cast inside `project`, which the chunked loss makes again in its backward pass: cast once
        # outside, the compute-dtype table would stay live from the forward pass through the backward loop.
        def project(h: jax.Array) -> jax.Array:  # [N, P, D] -> float32 logits [N, P, V]
            logits = jnp.einsum(spec, h, kernel.astype(blk.compute_dtype), preferred_element_type=jnp.float32)
            if scale != 1.0:
                logits = logits * scale
            logits = logits + jnp.asarray(bias).astype(jnp.float32)[None, None, :]
            return nn.with_logical_constraint(logits, ("batch", None, "act_vocab"))

        if targets is not None:
            return chunked_cross_entropy(project, h, targets, chunks)
        logits = project(h)
        chex.assert_type(logits, jnp.float32)
        return logits


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per row: float32[..., V], int[...] -> float32[...].

    optax.softmax_cross_entropy_with_integer_labels' value, written as logsumexp(logits) minus the target's
    logit picked by comparison with the vocabulary index (not gathered), so that its gradient,
    softmax(logits) - onehot(target), is one elementwise expression: XLA's GPU compiler then writes the
    logits' gradient into one [..., V] buffer, where optax's gather leaves a second one (the scatter of its
    transpose): for BERT-base's head at 32 rows of 125 predictions, 477 MiB a chip less (TPU: the same).
    tests/jaxblock/test_mlm.py holds it to optax's values and gradients."""
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


def chunked_cross_entropy(
    project: Callable[[jax.Array], jax.Array], h: jax.Array, targets: jax.Array, chunks: int
) -> tuple[jax.Array, jax.Array]:
    """(losses float32[N, P], predicted int32[N, P]): `cross_entropy(project(h), targets)` and the argmax of
    `project(h)`, where `project` maps the head's features h [N, P, D] to float32 logits [N, P, V].

    The logits are made for ceil(P / chunks) slots at a time (`lax.map` over the slot groups, the last one
    padded) under `jax.checkpoint`: the backward pass makes each group's logits again from its features, so
    the step keeps h, not the float32 [N, P, V] logits from the forward to the backward pass, and at most one
    group's logits and their gradient exist at once. The price is the output projection's matmul once more
    (N * P * D * V multiply-adds). chunks=1 is the same computation, one group, still remade."""
    chex.assert_rank(h, 3)
    chex.assert_shape(targets, h.shape[:2])
    n, p, d = h.shape
    if not 1 <= chunks <= p:
        raise ValueError(f"chunks={chunks} must be in 1..P={p}")
    size = -(-p // chunks)
    pad = size * chunks - p
    groups = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(n, chunks, size, d).swapaxes(0, 1)  # [C, N, S, D]
    group_targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(n, chunks, size).swapaxes(0, 1)  # [C, N, S]
    groups = nn.with_logical_constraint(groups, (None, "batch", None, "act_embed"))
    group_targets = nn.with_logical_constraint(group_targets, (None, "batch", None))

    @jax.checkpoint
    def group(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        features, wanted = args
        logits = project(features)
        return cross_entropy(logits, wanted), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    losses, predicted = jax.lax.map(group, (groups, group_targets))  # [C, N, S] each
    return (losses.swapaxes(0, 1).reshape(n, chunks * size)[:, :p],
            predicted.swapaxes(0, 1).reshape(n, chunks * size)[:, :p])


def mlm_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, Metrics]:
    """Mean cross-entropy over chosen positions only.

    logits float32[N, P, V], targets int[N, P] (the original ids), weights bool[N, P] (True = counts).
    Returns (loss, {"loss", "accuracy", "count"}); with no chosen position the loss is 0, not NaN.
    """
    chex.assert_rank(logits, 3)
    chex.assert_equal_shape((targets, weights))
    w = weights.astype(jnp.float32)
    count = jnp.sum(w)
    per_token = cross_entropy(logits, targets)  # [N, P]
    # where, not multiply: a filler slot's non-finite loss must not reach the sum (0 * NaN = NaN).
    loss = jnp.sum(jnp.where(weights, per_token, 0.0)) / jnp.maximum(count, 1.0)
    hits = jnp.sum(jnp.where(weights, jnp.argmax(logits, axis=-1) == targets, False).astype(jnp.float32))
    return loss, {"loss": loss, "accuracy": hits / jnp.maximum(count, 1.0), "count": count}
