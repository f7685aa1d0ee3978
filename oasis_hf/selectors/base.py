"""The selector protocol: score every block of a layer; the layer keeps the top ones resident."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from oasis_hf.cache.layer import OasisLayer


class BlockSelector(ABC):
    """Scores blocks; higher means more worth keeping on the GPU.

    The layer adds the rules every policy shares: sinks and the recent window always resident, padding and blocks
    past the end never chosen, at most ``S`` blocks, at most ``max_fetch_blocks`` fetched per step.
    To add a policy: one file here with a subclass, one line in ``SELECTORS`` (``selectors/__init__.py``), one row
    in ``tests/test_selectors.py``.
    """

    name: ClassVar[str]
    #: The score is fixed-shape device work with no host synchronisation, so the decode step that calls it can be
    #: captured in a CUDA graph. Set False for selectors that read host memory or branch on data.
    capturable: ClassVar[bool] = True
    #: Selects for the *next* step after this one ran (a prefetch job, on the worker when ``prefetch`` is on);
    #: False: selects for this step, inside it, before attention (synchronous).
    asynchronous: ClassVar[bool] = False
    #: The prefill observation window and the selection memory (`OasisConfig.prefill_window_tokens`,
    #: `OasisConfig.score_decay`) apply to this selector's scores. False for ``static`` (its scores ignore the
    #: queries) and ``oracle`` (it must stay each step's exact top blocks: the reference the others are measured by).
    window_and_memory: ClassVar[bool] = True

    def lookahead_queries(self, query: torch.Tensor) -> torch.Tensor:
        """Asynchronous selectors: the rows of this forward's queries (B, H_q, T, D) that score the next step."""
        raise NotImplementedError(f"{type(self).__name__} selects synchronously")

    @abstractmethod
    def score(self, layer: OasisLayer, query: torch.Tensor, scale: float, block_ok: torch.Tensor) -> torch.Tensor:
        """Return (B, H_kv, NB_cap) float32 scores.

        query : (B, H_q, T, D) the queries of this forward (RoPE applied). block_ok : (B, 1, NB_cap) bool, the
        blocks that hold real tokens (entries outside it are ignored).
        """
