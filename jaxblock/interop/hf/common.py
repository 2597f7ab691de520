"""Shared pieces of the transformers conversion: the refusal type and the weight-layout table.

A `Mapping` row ties one transformers state-dict entry to one leaf of our params tree:
    kind 'same'  identical layout (embeddings, norm weights)
    kind 'flat'  a bias: ours [H, K] or [G, K] <-> transformers [H*K] / [G*K]; [D] stays [D]
    kind 'in1'   nn.Linear weight [out, in] <-> our kernel with 1 input axis: [D, H, K], [D, F], [D, C]
    kind 'in2'   nn.Linear weight [out, in] <-> our kernel with 2 input axes: the out-projection [H, K, D]
    kind 'ones'  a leaf transformers does not have (ModernBERT's first layer has no attention norm and our
                 per-layer setting skips it): read as ones, never written
`part` (i, n): the leaf is the i-th of n equal row blocks of the transformers tensor (a fused Wqkv, a GLU's
Wi holding both halves); writing concatenates the parts in order.
Every map is a transpose and/or reshape, hence linear: it converts gradients as it converts weights.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, NamedTuple

import numpy as np

Kind = Literal["same", "flat", "in1", "in2", "ones"]


class UnsupportedConfigError(ValueError):
    """A model or config the conversion cannot express exactly; the message is one line naming the field."""


class Mapping(NamedTuple):
    hf_name: str  # transformers state-dict key
    path: tuple[str, ...]  # our params path
    kind: Kind
    part: tuple[int, int] = (0, 1)


def refuse(field: str, value: Any, why: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{field}={value!r}: {why}")


def layout_to_ours(hf: np.ndarray, shape: tuple[int, ...], kind: Kind) -> np.ndarray:
    """transformers layout -> ours (shape: our leaf's shape)."""
    a = hf.T if kind in ("in1", "in2") else hf
    return np.ascontiguousarray(a.reshape(shape))


def layout_to_hf(ours: np.ndarray, kind: Kind) -> np.ndarray:
    """Our layout -> transformers'."""
    if kind == "flat":
        return ours.reshape(-1)
    if kind in ("in1", "in2"):
        n_in = 1 if kind == "in1" else 2
        return np.ascontiguousarray(ours.reshape(int(np.prod(ours.shape[:n_in])), -1).T)
    return ours


def get_path(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def linear(
    hf_prefix: str, path: tuple[str, ...], *, bias: bool, n_in: int = 1, bias_flat: bool = False,
    part: tuple[int, int] = (0, 1),
) -> list[Mapping]:
    """An nn.Linear (weight, optional bias) onto our kernel/bias pair under `path` (`part`: its row block)."""
    rows = [Mapping(f"{hf_prefix}.weight", (*path, "kernel"), "in1" if n_in == 1 else "in2", part)]
    if bias:
        rows.append(Mapping(f"{hf_prefix}.bias", (*path, "bias"), "flat" if bias_flat else "same", part))
    return rows


def take_part(hf: np.ndarray, part: tuple[int, int]) -> np.ndarray:
    """The part[0]-th of part[1] equal blocks of rows (axis 0) of a transformers tensor."""
    i, n = part
    size = hf.shape[0] // n
    return hf[i * size : (i + 1) * size]


def norm(hf_prefix: str, path: tuple[str, ...], *, bias: bool) -> list[Mapping]:
    rows = [Mapping(f"{hf_prefix}.weight", (*path, "scale"), "same")]
    return rows + ([Mapping(f"{hf_prefix}.bias", (*path, "bias"), "same")] if bias else [])


# EncoderConfig fields (dotted) that only some families hold, with the value meaning "not used".
_EXTRAS: dict[str, tuple[Any, str]] = {
    "embedding.dim": (None, "the embeddings are as wide as the blocks"),
    "layers.window": (None, "every layer attends to every key"),
    "layers.rope_base": (None, "one RoPE base for every layer"),
    "layers.attn_norm": (None, "every layer has its attention norm"),
    "pooler.norm": (False, "the head has no norm after its pooler"),
    "pooler.bias": (True, "the pooler dense has a bias"),
    "pooler.dense": (None, "a pooler dense only with pooling='cls'"),
}


def field(cfg: Any, dotted: str) -> Any:
    """The value of the dotted EncoderConfig key `dotted` (e.g. 'pooler.dense')."""
    return functools.reduce(getattr, dotted.split("."), cfg)


def refuse_extras(cfg: Any, family: str, *, allowed: tuple[str, ...] = ()) -> None:
    """Refuse (one line) any family-specific EncoderConfig field this family cannot hold."""
    for name, (unused, why) in _EXTRAS.items():
        value = field(cfg, name)
        if name not in allowed and value != unused and not (name == "embedding.dim" and value == cfg.block.model_dim):
            raise refuse(name, value, f"{family} cannot express it ({why})")


def check_all(checks: list[tuple[str, Any, bool, str]], family: str) -> None:
    """Raise on the first (field, value, bad, why) row that is bad."""
    for name, value, bad, why in checks:
        if bad:
            raise refuse(name, value, f"{family} cannot express it ({why})")
