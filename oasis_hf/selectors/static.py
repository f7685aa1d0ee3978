"""``static``: StreamingLLM at equal budget — sinks plus the most recent blocks, whatever the queries say.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023), https://arxiv.org/abs/2309.17453
"""

from __future__ import annotations

import torch

from oasis_hf.selectors.base import BlockSelector


class StaticSelector(BlockSelector):
    name = "static"
    window_and_memory = False

    def score(self, layer, query: torch.Tensor, scale: float, block_ok: torch.Tensor) -> torch.Tensor:
        batch, num_kv_heads = query.shape[0], layer.num_kv_heads
        recency = torch.arange(block_ok.shape[-1], device=query.device, dtype=torch.float32)
        return recency.expand(batch, num_kv_heads, -1)
