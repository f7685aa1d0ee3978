"""`BlockSummaries`: a compact description of every block's keys, kept on the GPU and used to score blocks.

Chosen by attention mass captured per byte, measured on Qwen2.5-Coder-1.5B at 13.7k tokens with a 2048-token budget
(``shared/docs/design.md``): exact keys capture 0.919 of the mass, the **mean key** of a block 0.903 at 1/32 of the
key bytes (block 32), 4-bit keys 0.915 at 1/4 of the bytes, and Quest's per-channel min/max bound only 0.867 at
2/32. At 32k tokens on an 8B shape 4-bit keys alone would take 512 MiB per sequence, twice the 256 MiB budget
pool, while mean keys take 64 MiB: ``"mean"`` is the default, ``"minmax"`` (Quest) is kept as a baseline. Mass is not
the whole story: on the accuracy suite at budget 512 (H200, Qwen2.5-Coder-1.5B, 8k and 16k) the bounds answered more
vt and recall_list prompts than mean keys and fewer cwe and fwe ones, the suite average 0.4 and 1.1 lower
(docs/results.md, "Mean keys, Quest's bounds, or both"). An upper bound ranks first the block with one key that
matches (a fact to retrieve); a mean ranks the blocks where many keys match (words to count). ``"mean+minmax"``
keeps both and lets each propose, a block's score being the average of its two softmax shares: there it scored 1.8
and 2.1 above mean keys at budget 512 and within 0.15 at 2048, for three times the bytes and twice the scoring work.

``"quantized"`` keeps the bounds, the mean key and every key at 2 bits per channel inside the bounds (KIVI's
per-channel key quantization, with the block as the group), and scores tokens instead of blocks: a row's softmax
runs over every real token's logit against its dequantized key, and a block's share is its tokens' shares. Offline,
on the suite's prompts (``eval.rank_summaries``: Qwen2.5-Coder-0.5B at 4k, 1.5B at 8k, blocks of 16) it picked
0.82-0.83 of the exact attention's top blocks where ``mean+minmax`` picked 0.71. Its codes take ``BS * D / 4``
bytes per block (1/8 of the keys; 7/32 with the three vectors at blocks of 32). Reading every block's codes per
scoring is a pass over the whole context, so by default (`OasisConfig.quantized_rerank`) it scores in two stages:
``mean+minmax`` rates every block and only the codes of the best ``k * S`` are read, each other block counting in a
row's softmax as its tokens at its mean key's logit.

Scoring reads `BlockSummaries.data` directly (`oasis_hf.kernels.score_blocks`); a prompt's blocks are summarised by
`oasis_hf.kernels.summarize_keys` (`BlockSummaries.write`), a decode step's new blocks inside
`oasis_hf.kernels.append_tokens`.
"""

from __future__ import annotations

import torch

from oasis_hf.kernels import summarize_keys, summarize_keys_ref, use_triton
from oasis_hf.kernels.ref import CODES_PER_BYTE, SUMMARY_LAYOUT


class BlockSummaries:
    """Per-block key summaries of one layer: `data` is (n, B, H_kv, NB_cap, D) in the layout `SUMMARY_LAYOUT` gives
    for `kind`: n = 1 (``mean``: the mean key), 2 (``minmax``: per-channel lo, hi) or 3 (``mean+minmax`` and
    ``quantized``: lo, hi, mean). `codes` is (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8 for ``quantized``
    (`oasis_hf.kernels.ref.quantize_blocks`), else None."""

    def __init__(self, kind: str, batch_size: int, num_kv_heads: int, capacity_blocks: int, head_dim: int,
                 dtype: torch.dtype, device, block_size: int) -> None:
        if kind not in SUMMARY_LAYOUT:
            raise ValueError(f"unknown block summary {kind!r}; choose one of {list(SUMMARY_LAYOUT)}")
        self.kind = kind
        self.block_size = block_size
        count = len(SUMMARY_LAYOUT[kind])
        self.data = torch.zeros(count, batch_size, num_kv_heads, capacity_blocks, head_dim, dtype=dtype, device=device)
        self.codes = None
        if kind == "quantized":
            if head_dim % CODES_PER_BYTE:
                raise ValueError(f"the 'quantized' block summary packs {CODES_PER_BYTE} channels per byte; head_dim "
                                 f"{head_dim} is not a multiple of {CODES_PER_BYTE}: use summary='mean+minmax'")
            self.codes = torch.zeros(batch_size, num_kv_heads, capacity_blocks, block_size,
                                     head_dim // CODES_PER_BYTE, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        codes = 0 if self.codes is None else self.codes.numel()
        return self.data.numel() * self.data.element_size() + codes

    def zero_(self) -> None:
        self.data.zero_()
        if self.codes is not None:
            self.codes.zero_()

    @property
    def capacity_blocks(self) -> int:
        return self.data.shape[3]

    def grow(self, capacity_blocks: int) -> None:
        if capacity_blocks <= self.capacity_blocks:
            return
        if self.codes is not None:
            codes = self.codes.new_zeros(*self.codes.shape[:2], capacity_blocks, *self.codes.shape[3:])
            codes[:, :, : self.capacity_blocks] = self.codes
            self.codes = codes
        grown = self.data.new_zeros(*self.data.shape[:3], capacity_blocks, self.data.shape[4])
        grown[:, :, :, : self.capacity_blocks] = self.data
        self.data = grown

    def write(self, keys: torch.Tensor, kv_start: torch.Tensor, first_block: int = 0, backend: str = "auto") -> None:
        """Summarise blocks ``first_block .. ceil(L / BS) - 1`` of `keys` (B, H_kv, L, D), every key at positions
        ``0 .. L - 1``; `kv_start` (B,) each sequence's first real position. One launch (`summarize_keys`, or its
        twin by `backend`); fixed shapes, no host synchronisation."""
        summarize = summarize_keys if use_triton(keys, backend) else summarize_keys_ref
        summarize(keys, kv_start, self.data, kind=self.kind, block_size=self.block_size, first_block=first_block,
                  codes=self.codes)
