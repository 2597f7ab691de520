"""The on/off switch of a CPU-only speed workaround: on for XLA's CPU backend unless forced while tracing.

jaxblock/cpu_residual_gradient.py, jaxblock/cpu_weight_gradient.py and LayerNorm's written-out backward
(jaxblock/norms.py) each hold one. The bench forces one off to measure what it buys; forward-mode
autodiff forces them off to trace the plain formulas (docs/model.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import jax


class CpuSwitch:
    """`applies()`: whether the workaround is traced in; `forced(enabled)`: override it while tracing."""

    def __init__(self) -> None:
        self._forced: bool | None = None  # None: decide by backend

    def applies(self) -> bool:
        return jax.default_backend() == "cpu" if self._forced is None else self._forced

    @contextmanager
    def forced(self, enabled: bool) -> Iterator[None]:
        previous, self._forced = self._forced, enabled
        try:
            yield
        finally:
            self._forced = previous
