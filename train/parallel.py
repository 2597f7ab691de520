"""Where the step is compiled and data is placed: the only module that knows about devices.

`make_runner(config, state)` returns a Runner for `parallel.strategy`:
- single:  jax.jit(train_step, donate_argnums=0) on one device.
(pmap and sharded strategies are added here; the loop only talks to the Runner interface.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from train.config import Config
from train.state import TrainState
from train.step import Metrics, eval_step, train_step


@dataclass
class Runner:
    """Compiled steps plus placement. Batches come in as host numpy dicts (this process's share)."""

    strategy: str
    _train: Any
    _eval: Any

    def place_state(self, state: TrainState) -> TrainState:
        return jax.device_put(state)

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return jax.device_put(batch)

    def train_step(self, state: TrainState, batch: dict[str, np.ndarray], rng: jax.Array) -> tuple[TrainState, Metrics]:
        return self._train(state, self.place_batch(batch), rng)

    def eval_step(self, state: TrainState, batch: dict[str, np.ndarray]) -> Metrics:
        return self._eval(state, self.place_batch(batch))

    def unreplicate(self, state: TrainState) -> TrainState:
        """A state whose leaves are ordinary (host-fetchable, checkpointable) arrays."""
        return state


def make_runner(config: Config, state: TrainState) -> Runner:
    strategy = config.parallel.strategy
    if strategy == "single" or jax.device_count() == 1:
        return Runner("single", jax.jit(train_step, donate_argnums=0), jax.jit(eval_step))
    raise ValueError(f"parallel.strategy={strategy} is not available yet: use parallel.strategy=single")
