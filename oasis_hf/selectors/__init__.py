"""Block selection policies, by name. One file per policy; `get_selector` builds one from its name.

The registry names each policy's module and class; the classes (which import torch) load on first use of
`SELECTORS`, so listing the names (`NAMES`, the CLI's choices) imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oasis_hf.selectors.base import BlockSelector

#: name -> (module in this package, class); each class's ``name`` is its key.
_REGISTRY = {
    "current-query": ("current_query", "CurrentQuerySelector"),
    "static": ("static", "StaticSelector"),
    "oracle": ("oracle", "OracleSelector"),
    "previous-query": ("previous_query", "PreviousQuerySelector"),
    "lookahead": ("lookahead", "LookaheadSelector"),
}
NAMES: tuple[str, ...] = tuple(_REGISTRY)


def _load() -> dict[str, type[BlockSelector]]:
    classes = {}
    for name, (module, cls) in _REGISTRY.items():
        selector = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
        if selector.name != name:
            raise RuntimeError(f"{cls}.name is {selector.name!r} but the registry lists it as {name!r}")
        classes[name] = selector
    return classes


def __getattr__(name: str):
    if name == "SELECTORS":
        value = _load()
    elif name == "BlockSelector":
        from oasis_hf.selectors.base import BlockSelector as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def get_selector(name: str) -> BlockSelector:
    selectors = globals().get("SELECTORS") or __getattr__("SELECTORS")
    try:
        return selectors[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of {sorted(selectors)}") from None


__all__ = ["NAMES", "SELECTORS", "BlockSelector", "get_selector"]
