"""`BlockSummaries`: a compact description of every block's keys, kept on the GPU and used to score blocks.

Chosen by attention mass captured per byte, measured on Qwen2.5-Coder-1.5B at 13.7k tokens with a 2048-token budget
(``shared/docs/design.md``): exact keys capture 0.919 of the mass, the **mean key** of a block 0.903 at 1/32 of the
key bytes (block 32), 4-bit keys 0.915 at 1/4 of the bytes, and Quest's per-channel min/max bound only 0.867 at
2/32. At 32k tokens on an 8B shape 4-bit keys alone would take 512 MiB per sequence, twice the 256 MiB budget
pool, while mean keys take 64 MiB: ``"mean"`` is the default, ``"minmax"`` (Quest) is kept as a baseline. Mass is not
the whole story: on the accuracy suite's recall_list, vt and multi-value/multi-query needle prompts (CPU,
Qwen2.5-Coder-0.5B, 4k tokens, blocks of 16) minmax captured less mass but answered more in each (README, "Mean keys or
Quest's bounds"); the GPU A/B is still to run.
"""

from __future__ import annotations

import torch

from oasis_hf.kernels import score_blocks, score_blocks_ref, use_triton


class BlockSummaries:
    """Per-block key summaries of one layer: (B, H_kv, NB_cap, D) (``mean``) or two of them (``minmax``)."""

    def __init__(self, kind: str, batch_size: int, num_kv_heads: int, capacity_blocks: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:
        self.kind = kind
        count = 1 if kind == "mean" else 2
        self.data = torch.zeros(count, batch_size, num_kv_heads, capacity_blocks, head_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def capacity_blocks(self) -> int:
        return self.data.shape[3]

    def grow(self, capacity_blocks: int) -> None:
        if capacity_blocks <= self.capacity_blocks:
            return
        grown = self.data.new_zeros(*self.data.shape[:3], capacity_blocks, self.data.shape[4])
        grown[:, :, :, : self.capacity_blocks] = self.data
        self.data = grown

    def write(self, block_ids: torch.Tensor, blocks_k: torch.Tensor, token_ok: torch.Tensor) -> None:
        """Summarise ``n`` blocks.

        block_ids : (n,) long, logical block of each entry (repeats allowed when they carry the same keys);
        blocks_k : (B, H_kv, n, BS, D) keys; token_ok : (B, 1, n, BS) bool, False for padding / unwritten tokens.
        Fixed shapes and no host synchronisation: the decode step captures this in a CUDA graph.
        """
        ok = token_ok[..., None]
        if self.kind == "mean":
            total = torch.where(ok, blocks_k.float(), 0.0).sum(3)
            count = ok.sum(3).clamp(min=1)
            self.data[0].index_copy_(2, block_ids, (total / count).to(self.data.dtype))
        else:
            k = blocks_k.float()
            any_ok = ok.any(3)
            low = torch.where(ok, k, float("inf")).amin(3)
            high = torch.where(ok, k, float("-inf")).amax(3)
            self.data[0].index_copy_(2, block_ids, torch.where(any_ok, low, 0.0).to(self.data.dtype))
            self.data[1].index_copy_(2, block_ids, torch.where(any_ok, high, 0.0).to(self.data.dtype))

    def score(self, query: torch.Tensor, scale: float, block_ok: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """Importance of every block for `query`: (B, H_kv, NB_cap) float32.

        query : (B, H_q, T, D). Each query row's block logits (mean key: the mean logit of the block; minmax: Quest's
        upper bound) go through a softmax over the valid blocks (`block_ok`: (B, 1, NB_cap) bool), then the rows of a
        GQA group and of all ``T`` tokens are summed, so the group shares one selection. Both kinds are one Triton
        launch on the GPU (`score_blocks`), its twin elsewhere: Quest's bound ``sum_d max(q_d lo_d, q_d hi_d)`` is
        ``relu(q) . hi + min(q, 0) . lo`` (``hi >= lo``), one dot product over ``2 D`` channels.
        """
        ok = block_ok[:, 0]
        fn = score_blocks if use_triton(query, backend) else score_blocks_ref
        if self.kind == "mean":
            return fn(query.contiguous(), self.data[0], ok, scale)
        signed = torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=-1)  # (B, H_q, T, 2D)
        bounds = torch.cat([self.data[1], self.data[0]], dim=-1)  # (B, H_kv, NB_cap, 2D): hi, then lo
        return fn(signed, bounds, ok, scale)
