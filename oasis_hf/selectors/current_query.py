"""``current-query``: score every block with this step's own queries against the block summaries (Quest-style).

Synchronous: the blocks it picks are fetched before the step's attention runs. It is the working default until the
lookahead prefetcher scores with draft-token queries ahead of time.
"""

from __future__ import annotations

from oasis_hf.selectors.base import BlockSelector


class CurrentQuerySelector(BlockSelector):
    name = "current-query"
