"""``oracle``: exact attention mass per block from the full keys in host memory.

For tests and for measuring the recall of the other selectors: it reads every key of the layer from the host store
each step (slow by design), computes this step's exact softmax attention, and scores each block by the probability
mass it holds (GQA group and query tokens summed).
"""

from __future__ import annotations

import torch

from oasis_hf.selectors.base import BlockSelector, ScoringContext


class OracleSelector(BlockSelector):
    name = "oracle"
    scoring = "custom"
    capturable = False  # reads every key back from host memory and synchronises
    window_and_memory = False  # the exact top of each step, nothing remembered

    def score(self, context: ScoringContext, query: torch.Tensor, scale: float) -> torch.Tensor:
        return context.exact_block_mass(query, scale)
