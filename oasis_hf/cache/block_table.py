"""`BlockTable`: which logical blocks are resident in which GPU slots, per (sequence, KV head).

Pure tensor bookkeeping (no host synchronisation, fixed shapes), so it runs on the pool's device inside the decode
step and can be tested on the CPU. Each (sequence, KV head) owns ``S`` slots; ``slot_block`` maps slot -> block and
``block_slot`` block -> slot. Both carry one extra "trash" column that masked-out scatters write to, so every update
is a fixed-shape scatter with no data-dependent control flow.

Invariants (checked by `check`): a slot holds at most one block, a block sits in at most one slot, the two maps are
inverse, and at most ``S`` blocks are resident.
"""

from __future__ import annotations

import torch

from oasis_hf.kernels import use_triton
from oasis_hf.kernels.plan_blocks import plan_blocks
from oasis_hf.kernels.plan_blocks import supported as plan_kernel_supported
from oasis_hf.kernels.ref import assign_blocks, plan_blocks_ref, propose_blocks, refresh_slot_scores

INF = float("inf")


class BlockTable:
    """Residency table of one layer.

    Parameters
    ----------
    batch_size, num_kv_heads : leading dims ``(B, H_kv)``.
    num_slots : ``S``, block slots per (sequence, KV head).
    capacity_blocks : logical blocks addressable (grows with `grow`).
    device : where the table lives (the pool's device).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, num_slots: int, capacity_blocks: int, device) -> None:
        self.num_slots = num_slots
        shape = (batch_size, num_kv_heads)
        self.slot_block = torch.full((*shape, num_slots + 1), -1, dtype=torch.long, device=device)
        self.slot_score = torch.full((*shape, num_slots + 1), -INF, dtype=torch.float32, device=device)
        self.block_slot = torch.full((*shape, max(capacity_blocks, num_slots) + 1), -1, dtype=torch.long, device=device)

    @property
    def capacity_blocks(self) -> int:
        return self.block_slot.shape[-1] - 1

    def grow(self, capacity_blocks: int) -> None:
        """Address at least `capacity_blocks` logical blocks (copies the small block->slot map only)."""
        if capacity_blocks <= self.capacity_blocks:
            return
        grown = torch.full(
            (*self.block_slot.shape[:2], capacity_blocks + 1), -1, dtype=torch.long, device=self.block_slot.device
        )
        grown[..., : self.capacity_blocks] = self.block_slot[..., :-1]
        self.block_slot = grown

    def reset(self) -> None:
        self.slot_block.fill_(-1)
        self.block_slot.fill_(-1)
        self.slot_score.fill_(-INF)

    # ------------------------------------------------------------------------------------------------- updates
    def assign(self, blocks: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor, scores: torch.Tensor) -> None:
        """Install ``blocks[..., j]`` into ``slots[..., j]`` where `valid`, evicting what those slots held.

        All arguments are (B, H_kv, N); the valid slots of one (sequence, head) must be distinct and the blocks
        not resident elsewhere.
        """
        assign_blocks(self.slot_block, self.slot_score, self.block_slot, blocks, slots, valid, scores)

    def plan(
        self,
        scores: torch.Tensor,
        max_fetch: int | None,
        backend: str = "torch",
        fetched: torch.Tensor | None = None,
        keep_margin: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Make the top-``S`` blocks by `scores` resident (misses are the delta), and return the fetch plan.

        Parameters
        ----------
        scores : (B, H_kv, NB_cap) float
            Importance per logical block: ``+inf`` must be resident, ``-inf`` must not be chosen.
        max_fetch : int | None
            Cap on misses fetched that are not ``+inf`` (best first); the least important resident blocks go.
        backend : `OasisConfig.kernel_backend`: ``"auto"`` runs the one-launch Triton kernel `plan_blocks` on CUDA
            (tables up to its size limit), ``"torch"`` the PyTorch twin; both give the same plan and table.
        fetched : (1,) int64 or None — device counter the number of blocks to fetch is added to.
        keep_margin : `OasisConfig.keep_margin`: resident blocks rank at ``1 + keep_margin`` times their score.

        Returns
        -------
        blocks, slots, valid : (B, H_kv, S) — fetch ``blocks[j]`` into ``slots[j]`` where ``valid[j]``.
        The table is already updated; the caller copies the data before reading the pool.
        """
        scores = scores.float()
        tables = (scores, self.slot_block, self.slot_score, self.block_slot, max_fetch, fetched, keep_margin)
        if use_triton(scores, backend) and plan_kernel_supported(scores.shape[-1], self.num_slots):
            return plan_blocks(*tables)
        return plan_blocks_ref(*tables)

    def propose(self, scores: torch.Tensor, max_fetch: int | None, keep_margin: float = 0.0):
        """`plan` without touching the table: (blocks, slots, valid, block_scores), each (B, H_kv, S), the valid
        entries first. `commit` applies it later (the ``stale`` prefetch policy)."""
        return propose_blocks(scores, self.slot_block, self.block_slot, max_fetch, keep_margin)

    def refresh_scores(self, scores: torch.Tensor) -> None:
        """Refresh the importance of everything resident with `scores` (the eviction order of the next plan);
        blocks past the width of `scores` (the table grew since) keep theirs."""
        refresh_slot_scores(self.slot_block, self.slot_score, scores)

    def commit(self, blocks, slots, valid, expected, block_scores, scores) -> torch.Tensor:
        """Apply a proposal made earlier against a table that may have changed since: an entry installs
        ``blocks[j]`` into ``slots[j]`` only if that slot still holds ``expected[j]`` and the block is not resident
        elsewhere. Returns the entries applied (B, H_kv, N); the caller copies their data into the pool."""
        applied = valid & (self.slot_block.gather(-1, slots) == expected)
        applied &= self.block_slot.gather(-1, blocks.clamp(0, self.capacity_blocks - 1)) < 0
        self.assign(blocks, slots, applied, block_scores)
        self.refresh_scores(scores)
        return applied

    def drop_from(self, first_block: int) -> None:
        """Forget every block >= `first_block` (after `crop`)."""
        gone = self.slot_block[..., : self.num_slots] >= first_block
        self.slot_block[..., : self.num_slots].masked_fill_(gone, -1)
        self.slot_score[..., : self.num_slots].masked_fill_(gone, -INF)
        self.block_slot[..., first_block:].fill_(-1)

    # ---------------------------------------------------------------------------------------------- invariants
    def resident_count(self) -> torch.Tensor:
        """(B, H_kv) number of resident blocks."""
        return (self.slot_block[..., : self.num_slots] >= 0).sum(-1)

    def check(self) -> None:
        """Raise AssertionError if an invariant is broken (tests; syncs with the device)."""
        slots = self.slot_block[..., : self.num_slots].cpu()
        blocks = self.block_slot[..., :-1].cpu()
        batch, heads, _ = slots.shape
        for b in range(batch):
            for h in range(heads):
                held = slots[b, h][slots[b, h] >= 0].tolist()
                assert len(held) == len(set(held)), f"block in two slots at (b={b}, h={h}): {held}"
                assert len(held) <= self.num_slots
                for s, blk in enumerate(slots[b, h].tolist()):
                    if blk >= 0:
                        assert blocks[b, h, blk] == s, f"block_slot[{blk}]={blocks[b, h, blk]} but slot {s} holds it"
                mapped = (blocks[b, h] >= 0).nonzero().flatten().tolist()
                assert sorted(mapped) == sorted(held), f"maps disagree at (b={b}, h={h}): {mapped} vs {held}"
