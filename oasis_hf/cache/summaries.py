"""`BlockSummaries`: a compact description of every block's keys, kept on the GPU and used to score blocks.

Chosen by attention mass captured per byte, measured on Qwen2.5-Coder-1.5B at 13.7k tokens with a 2048-token budget
(``shared/docs/design.md``): exact keys capture 0.919 of the mass, the **mean key** of a block 0.903 at 1/32 of the
key bytes (block 32), 4-bit keys 0.915 at 1/4 of the bytes, and Quest's per-channel min/max bound only 0.867 at
2/32. At 32k tokens on an 8B shape 4-bit keys alone would take 512 MiB per sequence, twice the 256 MiB budget
pool, while mean keys take 64 MiB: ``"mean"`` is the default, ``"minmax"`` (Quest) is kept as a baseline. Mass is not
the whole story: on the accuracy suite at budget 512 (H200, Qwen2.5-Coder-1.5B, 8k and 16k) the bounds answered more
vt and recall_list prompts than mean keys and fewer cwe and fwe ones, the suite average 0.4 and 1.1 lower (README,
"Mean keys, Quest's bounds, or both"). An upper bound ranks first the block with one key that matches (a fact to
retrieve); a mean ranks the blocks where many keys match (words to count). ``"mean+minmax"`` keeps both and lets
each propose, a block's score being the average of its two softmax shares: there it scored 1.8 and 2.1 above mean
keys at budget 512 and within 0.15 at 2048, for three times the bytes and two scoring launches.
"""

from __future__ import annotations

import torch

from oasis_hf.kernels import score_blocks, score_blocks_ref, use_triton

# Summaries per kind, stacked in `BlockSummaries.data`: lo and hi (Quest's bounds) first, then the mean key.
_TENSORS = {"mean": ("mean",), "minmax": ("lo", "hi"), "mean+minmax": ("lo", "hi", "mean")}


class BlockSummaries:
    """Per-block key summaries of one layer: `data` is (n, B, H_kv, NB_cap, D), n = 1 (``mean``: the mean key),
    2 (``minmax``: per-channel lo, hi) or 3 (``mean+minmax``: lo, hi, mean)."""

    def __init__(self, kind: str, batch_size: int, num_kv_heads: int, capacity_blocks: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:
        if kind not in _TENSORS:
            raise ValueError(f"unknown block summary {kind!r}; choose one of {list(_TENSORS)}")
        self.kind = kind
        self._slot = {name: i for i, name in enumerate(_TENSORS[kind])}
        count = len(_TENSORS[kind])
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
        k = blocks_k.float()
        if "mean" in self._slot:
            total = torch.where(ok, k, 0.0).sum(3)
            count = ok.sum(3).clamp(min=1)
            self.data[self._slot["mean"]].index_copy_(2, block_ids, (total / count).to(self.data.dtype))
        if "lo" in self._slot:
            any_ok = ok.any(3)
            low = torch.where(ok, k, float("inf")).amin(3)
            high = torch.where(ok, k, float("-inf")).amax(3)
            self.data[self._slot["lo"]].index_copy_(2, block_ids, torch.where(any_ok, low, 0.0).to(self.data.dtype))
            self.data[self._slot["hi"]].index_copy_(2, block_ids, torch.where(any_ok, high, 0.0).to(self.data.dtype))

    def score(self, query: torch.Tensor, scale: float, block_ok: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """Importance of every block for `query`: (B, H_kv, NB_cap) float32.

        query : (B, H_q, T, D). Each query row's block logits (mean key: the mean logit of the block; minmax: Quest's
        upper bound) go through a softmax over the valid blocks (`block_ok`: (B, 1, NB_cap) bool), then the rows of a
        GQA group and of all ``T`` tokens are summed, so the group shares one selection. Each kind is one Triton
        launch on the GPU (`score_blocks`), its twin elsewhere: Quest's bound ``sum_d max(q_d lo_d, q_d hi_d)`` is
        ``relu(q) . hi + min(q, 0) . lo`` (``hi >= lo``), one dot product over ``2 D`` channels. ``mean+minmax``
        launches both and averages the two scores (each row's shares still sum to 1).
        """
        ok = block_ok[:, 0]
        fn = score_blocks if use_triton(query, backend) else score_blocks_ref
        if "mean" in self._slot:
            by_mean = fn(query.contiguous(), self.data[self._slot["mean"]], ok, scale)
            if self.kind == "mean":
                return by_mean
        signed = torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=-1)  # (B, H_q, T, 2D)
        bounds = torch.cat([self.data[self._slot["hi"]], self.data[self._slot["lo"]]], dim=-1)  # (B, H_kv, NB_cap, 2D)
        by_bound = fn(signed, bounds, ok, scale)
        return by_bound if self.kind == "minmax" else 0.5 * (by_mean + by_bound)
