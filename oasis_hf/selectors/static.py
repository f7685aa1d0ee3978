"""``static``: StreamingLLM at equal budget — sinks plus the most recent blocks, whatever the queries say.

Its set changes only when a new block starts, and then by one known swap: the layer's decode step keeps it without
any selection (`append_tokens` gives the new block the slot of the oldest unpinned one).

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023), https://arxiv.org/abs/2309.17453
"""

from __future__ import annotations

from oasis_hf.selectors.base import BlockSelector


class StaticSelector(BlockSelector):
    name = "static"
    scoring = "recency"  # the block index: the latest blocks win, the queries are not read
    window_and_memory = False
