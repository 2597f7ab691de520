"""The loop's periodic work: when each action is due (`Every`) and what it sees after a step (`Tick`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from train.loop.state import TrainState


@dataclass
class Tick:
    """What the periodic work after step `done` sees: the state, whether this is the last step or the run is
    stopping, and the validation of this step once the validation has run (the checkpoint records it)."""

    state: TrainState
    done: int
    last: bool = False
    stopping: bool = False
    val: dict[str, float] | None = None


@dataclass(frozen=True)
class Every:
    """Periodic work: due when `every` divides the step, at the last step (`at_end`) and when the run is
    stopping (`on_stop`). `every` of 0 or None is never due on its own."""

    every: int | None
    action: Callable[[Tick], None] = lambda tick: None
    at_end: bool = True
    on_stop: bool = False

    def due(self, done: int, last: bool, stopping: bool) -> bool:
        return bool((self.every and done % self.every == 0) or (self.at_end and last) or (self.on_stop and stopping))

    def __call__(self, tick: Tick) -> None:
        if self.due(tick.done, tick.last, tick.stopping):
            self.action(tick)
