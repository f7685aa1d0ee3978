"""``lookahead``: choose the next step's blocks with the queries at the speculative draft positions (OasisKV).

A verification forward carries ``1 + k`` tokens: the last accepted token and ``k`` drafts (from an assistant model,
prompt lookup, or `oasis_hf.speculative_generate`). The target's queries at the draft positions are its own
prediction of what the next steps attend to; the prefetcher scores every block with all ``1 + k`` queries (the GQA
group and the tokens share one selection) and moves the delta in the background. Without drafts (``T = 1``) it is
the previous step's query, as in ``previous-query``.
"""

from __future__ import annotations

import torch

from oasis_hf.selectors.base import BlockSelector


class LookaheadSelector(BlockSelector):
    name = "lookahead"
    asynchronous = True

    def lookahead_queries(self, query: torch.Tensor) -> torch.Tensor:
        return query
