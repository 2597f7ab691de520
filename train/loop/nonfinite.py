"""Non-finite steps: where the first non-finite value appears, whether a state is finite, and the one-line
HaltError a halted run ends with (exit code 1)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxblock.diagnostics import first_nonfinite
from train.config import Config
from train.errors import HaltError
from train.tasks import CLASSIFICATION, Task


def locate_nonfinite(config: Config, params: Any, batch: dict[str, np.ndarray], task: Task = CLASSIFICATION) -> str:
    """The first block/sublayer whose recorded output is non-finite on `batch` (jaxblock.diagnostics),
    plus the likely cause when the batch itself holds token ids outside the vocabulary."""
    found = first_nonfinite(task.build_model(config.model), {"params": params}, batch)
    where = str(found) if not found.passed else (
        "none in the forward pass: the loss is finite, so the gradients overflowed in the backward pass")
    tokens, vocab = np.asarray(batch["tokens"]), config.model.vocab_size
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        where += (f"; the batch has token ids {tokens.min()}..{tokens.max()} outside [0, {vocab}): a corrupt batch "
                  "or the wrong tokenizer")
    return where


@jax.jit
def all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves))


def halt_error(config: Config, done: int, consecutive: int, where: str, newest: int | None) -> HaltError:
    """The error of a run halted at step `done`: why (train.nonfinite), where, and the checkpoint to resume from."""
    why = ("train.nonfinite=halt" if config.train.nonfinite == "halt"
           else f"{consecutive} consecutive non-finite steps (train.max_nonfinite)")
    return HaltError(
        f"halted at step {done}: non-finite loss or gradients ({why}); {where}; "
        f"newest checkpoint: {newest if newest is not None else 'none'} (finite): lower optim.lr, check the "
        "data, or set train.nonfinite=skip, then rerun the same command to resume from it"
    )
