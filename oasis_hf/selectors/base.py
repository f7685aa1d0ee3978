"""The selector protocol: score every block of a layer; the layer keeps the top ones resident."""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class ScoringContext:
    """What a selector with ``scoring = "custom"`` may read of the layer whose blocks it scores."""

    #: (n, B, H_kv, NB_cap, D) block summaries in the model's dtype, in the layout `SUMMARY_LAYOUT[kind]` gives
    #: (`oasis_hf.kernels.ref`): mean keys, per-channel lo / hi bounds, or both.
    summaries: torch.Tensor
    #: `OasisConfig.kernel_backend` of the cache.
    kernel_backend: str
    #: ``exact_block_mass(query, scale)``: (B, H_kv, NB_cap) exact softmax attention mass of `query` (B, H_q, T, D)
    #: per block, from the full keys in host memory (reads them back and synchronises: not capturable).
    exact_block_mass: Callable[[torch.Tensor, float], torch.Tensor]
    #: `OasisConfig.summary`: what `summaries` holds.
    kind: str = "mean"
    #: ``quantized`` only: (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8 codes of every key inside its block's
    #: bounds (`oasis_hf.kernels.ref.dequantize_blocks` turns them back into keys); None otherwise.
    codes: torch.Tensor | None = None


class BlockSelector(ABC):
    """Scores blocks; higher means more worth keeping on the GPU.

    The layer adds the rules every policy shares: sinks and the recent window always resident, padding and blocks
    past the end never chosen, at most ``S`` blocks, at most ``max_fetch_blocks`` fetched per step.
    To add a policy: one file here with a subclass, one line in the registry of ``selectors/__init__.py`` (its
    name, module and class), a row in the selector parametrizations of ``tests/test_generate.py``.
    """

    name: ClassVar[str]
    #: How blocks are scored: ``"summaries"`` (each query row's softmax share over the block summaries, rows of a GQA
    #: group summed: `oasis_hf.kernels.score_blocks`, fused with the shared rules), ``"recency"`` (the block index;
    #: a synchronous selector scored so selects nothing in the decode step: its new blocks evict the oldest) or
    #: ``"custom"`` (the selector's own `score`).
    scoring: ClassVar[str] = "summaries"
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

    def score(self, context: ScoringContext, query: torch.Tensor, scale: float) -> torch.Tensor:
        """``scoring = "custom"`` only: (B, H_kv, NB_cap) float32 raw scores of `query` (B, H_q, T, D), RoPE
        applied, from what `context` offers (the layer then applies the shared rules)."""
        raise NotImplementedError(f"{type(self).__name__} scores with {self.scoring!r}, not a score method")
