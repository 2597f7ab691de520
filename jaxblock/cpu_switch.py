"""The on/off switch of a CPU-only speed workaround: on when tracing for XLA's CPU backend unless forced.

"For the CPU" means the platform being lowered for (`jaxblock.attention.platform.target_platform()`), so
a TPU or CUDA program traced on a CPU host (`python -m train lower`, `train export`) carries none of them.

jaxblock/cpu_residual_gradient.py, jaxblock/cpu_weight_gradient.py and LayerNorm's written-out backward
(jaxblock/norms.py) each hold one. The bench forces one off to measure what it buys; forward-mode
autodiff forces them off to trace the plain formulas (docs/model.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class CpuSwitch:
    """`applies()`: whether the workaround is traced in; `forced(enabled)`: override it while tracing."""

    def __init__(self) -> None:
        self._forced: bool | None = None  # None: decide by the target platform

    def applies(self) -> bool:
        from jaxblock.attention.platform import target_platform  # the attention package imports this module

        return target_platform() == "cpu" if self._forced is None else self._forced

    @contextmanager
    def forced(self, enabled: bool) -> Iterator[None]:
        previous, self._forced = self._forced, enabled
        try:
            yield
        finally:
            self._forced = previous
