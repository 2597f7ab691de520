"""The processes of a run: joining a multi-host run, which process speaks for it, and reading a global array's
local copy. Every process runs the same program; only `is_primary()` logs."""

from __future__ import annotations

from typing import Any

import jax

from train.config import ConfigError, ParallelConfig


def initialize_distributed(cfg: ParallelConfig) -> None:
    """Join the multi-host run (no-op for one process). Must run before any JAX device is touched."""
    if not (cfg.distributed or cfg.coordinator) or jax.distributed.is_initialized():
        return
    try:
        jax.distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    except (RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"jax.distributed could not start ({first}): set parallel.coordinator=HOST:PORT "
            "parallel.num_processes=N parallel.process_id=I, or run under a detected cluster (SLURM, TPU VM)"
        ) from None


def is_primary() -> bool:
    """True on the one process that logs and writes metrics (process 0)."""
    return jax.process_index() == 0


def host_value(x: Any) -> Any:
    """A leaf this process can read: global replicated arrays give their local copy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x
