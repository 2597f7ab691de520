"""The on/off switch of a CPU-only speed workaround: on when tracing for XLA's CPU backend unless forced.

"For the CPU" means the platform being lowered for (`jaxblock.attention.platform.target_platform()`), so
a TPU or CUDA program traced on a CPU host (`python -m train lower`, `train export`) carries none of them.

jaxblock/cpu_residual_gradient.py, jaxblock/cpu_weight_gradient.py and LayerNorm's written-out backward
(jaxblock/norms.py) each hold one. The bench forces one off to measure what it buys; forward-mode
autodiff forces them off to trace the plain formulas (docs/model.md).

Each workaround shapes only a gradient. The model's pure functions that hold one (LayerNorm's, the
projections', the dense kernel's) run as one compiled program per argument shape when called eagerly
(`compiled_when_eager`), so their custom VJPs are traced once with that program, never per call; the
residual-gradient settle wraps a whole stack call instead and asks `applies_to(values)`: whether any of
the values it would wrap is traced (jit, grad, vmap, scan...). An eager call on concrete arrays, outside
any transformation, has no gradient to shape and runs the plain formulas (`traced`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import jax


class CpuSwitch:
    """`applies()`: whether the workaround is traced in; `forced(enabled)`: override it while tracing."""

    def __init__(self) -> None:
        self._forced: bool | None = None  # None: decide by the target platform

    def applies(self) -> bool:
        from jaxblock.attention.platform import target_platform  # the attention package imports this module

        return target_platform() == "cpu" if self._forced is None else self._forced

    def applies_to(self, *values: Any) -> bool:
        """`applies()` and some leaf of `values` is traced: only then can a gradient flow through them."""
        return self.applies() and traced(*values)

    @contextmanager
    def forced(self, enabled: bool) -> Iterator[None]:
        previous, self._forced = self._forced, enabled
        try:
            yield
        finally:
            self._forced = previous


def traced(*values: Any) -> bool:
    """Whether any leaf of `values` (pytrees) is a tracer: False for an eager call on concrete arrays,
    which no transformation (jit, grad, vmap, scan, eval_shape) is watching."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values))


F = TypeVar("F", bound=Callable[..., Any])


def compiled_when_eager(*static_argnames: str) -> Callable[[F], F]:
    """Decorator for a pure array function of the model: under a transformation (any argument leaf traced)
    it runs inline, so every jitted or differentiated program is exactly what it was; called eagerly on
    concrete arrays it runs as one compiled program per argument shape (`jax.jit`, `static_argnames`
    static) instead of dispatching, and compiling on first sight, each of its operations one by one. An
    eager LayerNorm was ~14 such operations, an eager dense attention ~15. The compiled form is the
    wrapper's `compiled` attribute."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if traced(args, kwargs) else call.compiled(*args, **kwargs)  # type: ignore[attr-defined]

        call.compiled = jax.jit(fn, static_argnames=static_argnames)  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap
