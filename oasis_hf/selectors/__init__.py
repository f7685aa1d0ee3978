"""Block selection policies, by name. One file per policy; `get_selector` builds one from its name."""

from __future__ import annotations

from oasis_hf.selectors.base import BlockSelector
from oasis_hf.selectors.current_query import CurrentQuerySelector
from oasis_hf.selectors.lookahead import LookaheadSelector
from oasis_hf.selectors.oracle import OracleSelector
from oasis_hf.selectors.previous_query import PreviousQuerySelector
from oasis_hf.selectors.static import StaticSelector

SELECTORS: dict[str, type[BlockSelector]] = {
    CurrentQuerySelector.name: CurrentQuerySelector,
    StaticSelector.name: StaticSelector,
    OracleSelector.name: OracleSelector,
    PreviousQuerySelector.name: PreviousQuerySelector,
    LookaheadSelector.name: LookaheadSelector,
}


def get_selector(name: str) -> BlockSelector:
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; choose one of {sorted(SELECTORS)}") from None


__all__ = ["SELECTORS", "BlockSelector", "get_selector"]
