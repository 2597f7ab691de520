"""The wiring of each placement as data: what EncoderBlock computes, in which order, from what.

    Pre-LN:   U = X + Drop(MHA(LN1(X)))        Y = U + Drop(FFN(LN2(U)))
    Post-LN:  U = LN1(X + Drop(MHA(X)))        Y = LN2(U + Drop(FFN(U)))

Every value the block records (collection 'intermediates') is a `Site`: its name, what kind of
sublayer produces it, which submodule of the block computes it, and which values it reads ("x" is
the block's input). A `Wiring` lists the sites in execution order and names the one that is the
block's output. Diagnostics replay this description with independent float64 norms, and the
PyTorch parity harness derives its hook points from it; tests/jaxblock/test_block.py checks it against a
real apply of EncoderBlock, so the code and this description cannot drift apart.

All values are [N, L, D].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["norm", "attention", "FFN", "residual add"]

BLOCK_INPUT = "x"


@dataclass(frozen=True)
class Site:
    """One recorded value. `inputs`: the values it reads; for a residual add (residual stream, branch)."""

    name: str
    kind: Kind
    inputs: tuple[str, ...]
    module: str | None = None  # the block's submodule that computes it (None: a plain add)


@dataclass(frozen=True)
class Branch:
    """A residual branch: its recorded output and the submodule whose last projection closes it."""

    name: str  # "attention" | "ffn": also BlockConfig.ablate's value for it
    site: str
    module: str
    out_projection: str


BRANCHES = (
    Branch("attention", "attn_branch", "self_attn", "out"),
    Branch("ffn", "ffn_branch", "ffn", "linear2"),
)


@dataclass(frozen=True)
class Wiring:
    """One placement: its sites in execution order; `output` names the site returned by the block."""

    placement: str
    sites: tuple[Site, ...]
    output: str

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sites)

    def site(self, name: str) -> Site:
        for s in self.sites:
            if s.name == name:
                return s
        raise KeyError(f"{self.placement}-LN records no site {name!r}: it records {', '.join(self.order)}")

    @property
    def norms(self) -> tuple[Site, ...]:
        return tuple(s for s in self.sites if s.kind == "norm")

    @property
    def adds(self) -> tuple[Site, ...]:
        return tuple(s for s in self.sites if s.kind == "residual add")

    @property
    def stream(self) -> tuple[str, ...]:
        """Recorded residual-stream values read by a later residual add (the block input excluded)."""
        return tuple(s.inputs[0] for s in self.adds if s.inputs[0] != BLOCK_INPUT)

    @property
    def output_is_normalized(self) -> bool:
        """Post-LN blocks end in a norm; Pre-LN blocks do not, so their stack needs a final norm."""
        return self.site(self.output).kind == "norm"

    def consumer(self, name: str, kind: Kind) -> Site | None:
        """The first site of `kind` that reads `name` (None if there is none)."""
        return next((s for s in self.sites if s.kind == kind and name in s.inputs), None)

    def replay(
        self,
        x: Any,
        branches: Mapping[str, Any],
        norm: Callable[[Any, str], Any],
    ) -> dict[str, Any]:
        """Every site's value recomputed from the block input, the branch outputs and `norm(value, module)`.

        branches: {branch site: value} (a zeroed branch is passed as zeros). Returns {site: value}
        plus "x"; the block's output is `result[self.output]`.
        """
        values: dict[str, Any] = {BLOCK_INPUT: x}
        for s in self.sites:
            if s.kind == "norm":
                assert s.module is not None
                values[s.name] = norm(values[s.inputs[0]], s.module)
            elif s.kind == "residual add":
                values[s.name] = values[s.inputs[0]] + values[s.inputs[1]]
            else:
                values[s.name] = branches[s.name]
        return values


PRE_LN = Wiring(
    "pre",
    (
        Site("norm1", "norm", (BLOCK_INPUT,), "attn_norm"),
        Site("attn_branch", "attention", ("norm1",), "self_attn"),
        Site("after_attn", "residual add", (BLOCK_INPUT, "attn_branch")),
        Site("norm2", "norm", ("after_attn",), "ffn_norm"),
        Site("ffn_branch", "FFN", ("norm2",), "ffn"),
        Site("after_ffn", "residual add", ("after_attn", "ffn_branch")),
    ),
    output="after_ffn",
)

POST_LN = Wiring(
    "post",
    (
        Site("attn_branch", "attention", (BLOCK_INPUT,), "self_attn"),
        Site("after_attn", "residual add", (BLOCK_INPUT, "attn_branch")),
        Site("norm1", "norm", ("after_attn",), "attn_norm"),
        Site("ffn_branch", "FFN", ("norm1",), "ffn"),
        Site("after_ffn", "residual add", ("norm1", "ffn_branch")),
        Site("norm2", "norm", ("after_ffn",), "ffn_norm"),
    ),
    output="norm2",
)

WIRINGS: dict[str, Wiring] = {"pre": PRE_LN, "post": POST_LN}


def wiring_of(config: Any) -> Wiring:
    """The wiring of a BlockConfig (or any config with a `block`), by its `norm` placement."""
    return WIRINGS[getattr(config, "block", config).norm]
