"""The family registry: what jaxblock knows about each transformers checkpoint family, one entry each.

A `Family` holds everything the conversion needs, so adding a family is one file under
`jaxblock/interop/hf/families/` that defines `FAMILY = Family(...)` (or a tuple `FAMILIES`); every module
there is imported on first use, in name order. `register(family)` adds one from anywhere (a test, a
plugin); a model_type already taken is refused unless `replace=True`. How to write one: docs/families.md.

The config side never needs transformers: `HFConfig` is config.json (or a model's `config.to_dict()`)
over the family's `defaults`, the values transformers' config class gives a field that the file leaves
out, so a minimal Hub config.json reads as transformers would read it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import Any

from jaxblock.config import EncoderConfig
from jaxblock.interop.hf.common import Mapping, refuse


class HFConfig:
    """A transformers config as plain data: attribute access over config.json merged onto defaults."""

    def __init__(self, raw: MappingABC[str, Any], defaults: MappingABC[str, Any]) -> None:
        data = dict(defaults) | {k: v for k, v in raw.items() if not k.startswith("_")}
        if "num_labels" not in raw and isinstance(raw.get("id2label"), dict):
            data["num_labels"] = len(raw["id2label"])  # config.json stores the labels, not their count
        data.setdefault("num_labels", 2)
        data.setdefault("architectures", None)
        self._data = data

    def __getattr__(self, name: str) -> Any:
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return self._data.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)


@dataclass(frozen=True)
class Family:
    """One checkpoint family.

    name            our name for it, the `family=` of to_hf and what from_hf/load_pretrained report
    model_types     config.json `model_type` values read as this family
    hf_class        transformers class stem: `<hf_class>Model` and `<hf_class>ForSequenceClassification`
    prefix          the base model's attribute in *ForSequenceClassification / *ForMaskedLM state dicts
    defaults        every config.json field the family reads, with transformers' default for it
    encoder_fields  (HFConfig, max_len) -> EncoderConfig fields; raises UnsupportedConfigError (via `refuse`)
                    for anything not expressible exactly: that is what the family refuses on the way in
    encoder_map     EncoderConfig -> Mapping rows, transformers names without the prefix -> our Encoder paths
    head_fields     HFConfig -> the PoolerConfig fields of its *ForSequenceClassification head (model.pooler)
    head_map        EncoderConfig -> Mapping rows, full transformers names of that head -> our Classifier paths
    hf_config       (EncoderConfig, classifier) -> transformers config keyword arguments; refuses (one line)
                    what transformers cannot hold: what the family refuses on the way out
    matches         EncoderConfig -> whether to_hf picks this family when none is named (first match wins,
                    by `priority`, lowest first); None: only when named
    base_kwargs     extra keyword arguments of `<hf_class>Model` (BERT: add_pooling_layer=False)
    """

    name: str
    model_types: tuple[str, ...]
    hf_class: str
    prefix: str
    defaults: MappingABC[str, Any]
    encoder_fields: Callable[[HFConfig, int | None], dict[str, Any]]
    encoder_map: Callable[[EncoderConfig], list[Mapping]]
    head_fields: Callable[[HFConfig], dict[str, Any]]
    head_map: Callable[[EncoderConfig], list[Mapping]]
    hf_config: Callable[[EncoderConfig, bool], dict[str, Any]]
    matches: Callable[[EncoderConfig], bool] | None = None
    priority: int = 100
    base_kwargs: MappingABC[str, Any] = field(default_factory=dict)

    def config(self, raw: MappingABC[str, Any]) -> HFConfig:
        return HFConfig(raw, self.defaults)


_REGISTRY: dict[str, Family] = {}
_BY_MODEL_TYPE: dict[str, Family] = {}
_DISCOVERED = False


def register(family: Family, *, replace: bool = False) -> Family:
    """Add a family (returns it, so a module may write FAMILY = register(Family(...)))."""
    taken = [t for t in (family.name, *family.model_types)
             if (t in _BY_MODEL_TYPE and _BY_MODEL_TYPE[t].name != family.name) or
             (t == family.name and t in _REGISTRY and _REGISTRY[t] is not family)]
    if taken and not replace:
        raise ValueError(f"family {family.name!r}: {taken[0]!r} is already registered: pick another name "
                         "or pass replace=True")
    _REGISTRY[family.name] = family
    for t in family.model_types:
        _BY_MODEL_TYPE[t] = family
    return family


def unregister(name: str) -> None:
    """Remove a family (tests that register a toy one clean up with this)."""
    fam = _REGISTRY.pop(name)
    for t in fam.model_types:
        if _BY_MODEL_TYPE.get(t) is fam:
            del _BY_MODEL_TYPE[t]


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    package = importlib.import_module("jaxblock.interop.hf.families")  # the package, not the function
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        found = getattr(module, "FAMILIES", None) or (getattr(module, "FAMILY", None),)
        for fam in found:
            if isinstance(fam, Family) and _REGISTRY.get(fam.name) is not fam:
                register(fam)


def families() -> dict[str, Family]:
    """Every registered family by name, in registration order."""
    _discover()
    return dict(_REGISTRY)


def family(name: str) -> Family:
    """A family by its name or one of its model_types; one-line UnsupportedConfigError when unknown."""
    _discover()
    found = _REGISTRY.get(name) or _BY_MODEL_TYPE.get(name)
    if found is None:
        raise refuse("model_type", name, f"not converted: jaxblock reads {', '.join(sorted(_BY_MODEL_TYPE))}")
    return found


def guess(cfg: EncoderConfig) -> Family:
    """The family `to_hf` writes when none is named: the first whose `matches` accepts the config."""
    for fam in sorted(families().values(), key=lambda f: f.priority):
        if fam.matches is not None and fam.matches(cfg):
            return fam
    raise refuse("family", None, "no registered family holds this config: pass family= to name one")
