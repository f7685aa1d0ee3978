"""Block planning in one launch: top-``S`` selection, hit/miss, eviction order, capped delta and table update.

The PyTorch form of the plan (`plan_blocks_ref`: sort, gathers, a scatter-add, two argsorts, four scatters, the
score refresh) is about 57 small kernels per layer; inside a captured CUDA graph each still costs a few
microseconds. Here one program per (sequence, KV head) does all of it:

1. the wanted blocks are the ``S`` best by (score, then lower index), the blocks resident before the plan ranked
   at ``1 + keep_margin`` times their score (hysteresis, `OasisConfig.keep_margin`; off at 0): a bisection over the
   order-preserving integer form of the scores finds the ``S``-th best score in 32 counting passes over the ``NB``
   scores held in registers, ties at that score go to the lowest indices (a prefix sum), and the ``S`` winners are
   compacted (a second prefix sum) into a scratch row and sorted, best first. Work grows linearly with ``NB`` (a
   full sort of the ``NB`` keys took 220 us per layer at 128k tokens on the H200, slower than the PyTorch twin);
2. a resident block is kept iff its key is at least the ``S``-th key (keys are unique), so hits need no search;
3. the eviction order (empty slots, then the least important residents, kept slots last) and the output order
   (misses first, in score order) are two sorts of packed keys over ``S`` entries;
4. the misses take the freed slots in order, the tables are written, and every slot's score is refreshed.

Ties are broken by index exactly as the twin does, so the kernel and `plan_blocks_ref` return identical plans and
tables. One program holds the ``NB`` scores of its table in registers: ``NB <= MAX_BLOCKS``.
"""

from __future__ import annotations

import torch

from oasis_hf.kernels.ref import check_keep_margin

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

#: Most logical blocks one program holds in registers (512k tokens at block size 32); larger tables use the twin.
MAX_BLOCKS = 16384
#: Most slots per (sequence, KV head) the kernel handles (budget 8192 tokens at block size 16).
MAX_SLOTS = 512


if triton is not None:

    @triton.jit
    def _ordered(x):
        # float32 -> int32 with the same order under signed comparison (-0.0 folded into +0.0 first)
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    # The integer arguments are not specialised (Triton would compile a variant per "divisible by 16" / "equals 1"
    # pattern of them): the sort networks take 3-7 s to compile, and the table's width changes as it grows, so a
    # specialised kernel recompiled in the middle of a generation. One variant per (NBP, SP, COUNT) remains.
    @triton.jit(do_not_specialize=["num_blocks", "num_slots", "stride_slot_row", "stride_block_row", "max_fetch"])
    def _plan_blocks_kernel(
        SCORES,
        SLOT_BLOCK,
        SLOT_SCORE,
        BLOCK_SLOT,
        OUT_BLOCKS,
        OUT_SLOTS,
        OUT_VALID,
        FETCHED,
        SCRATCH,
        num_blocks,
        num_slots,
        stride_slot_row,
        stride_block_row,
        max_fetch,
        keep,
        COUNT: tl.constexpr,
        KEEP: tl.constexpr,
        NBP: tl.constexpr,
        SP: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        scores = SCORES + row * num_blocks
        slot_block = SLOT_BLOCK + row * stride_slot_row
        slot_score = SLOT_SCORE + row * stride_slot_row
        block_slot = BLOCK_SLOT + row * stride_block_row
        scratch = SCRATCH + row * SP
        neg_inf = float("-inf")
        pos_inf = float("inf")

        # 1. The wanted blocks: the S best keys (score, then lower index), best first. Bisection for the S-th best
        # ordered score t: count(okey >= t) >= S > count(okey > t).
        ids = tl.arange(0, NBP)
        live = ids < num_blocks
        ranked = tl.load(scores + ids, mask=live, other=neg_inf)
        if KEEP:  # hysteresis: residents rank at `keep` (1 + OasisConfig.keep_margin) times their score
            ranked = tl.where(tl.load(block_slot + ids, mask=live, other=-1) >= 0, ranked * keep, ranked)
        okey = _ordered(ranked)  # int32 per block, in registers
        lo = tl.full((), -2147483648, tl.int64)
        hi = tl.full((), 2147483648, tl.int64)
        for _ in range(32):
            mid = (lo + hi) >> 1
            enough = tl.sum(((okey.to(tl.int64) >= mid) & live).to(tl.int32), axis=0) >= num_slots
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        above = (okey.to(tl.int64) > lo) & live
        tie = (okey.to(tl.int64) == lo) & live
        room = num_slots - tl.sum(above.to(tl.int32), axis=0)
        chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= room))
        place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(scratch + place, ids, mask=chosen)  # the S winners' block ids, compacted in index order
        tl.debug_barrier()  # the compacted row is complete before any thread reads it
        j = tl.arange(0, SP)
        in_s = j < num_slots
        picked = tl.load(scratch + j, mask=in_s, other=0)
        picked_score = tl.load(scores + picked, mask=in_s, other=neg_inf)
        if KEEP:
            picked_score = tl.where(tl.load(block_slot + picked, mask=in_s, other=-1) >= 0, picked_score * keep,
                                    picked_score)
        picked_key = (_ordered(picked_score).to(tl.int64) << 32) | (0x7FFFFFFF - picked).to(tl.int64)
        top_key = tl.sort(tl.where(in_s, picked_key, -0x7FFFFFFFFFFFFFFF), descending=True)
        wanted = 0x7FFFFFFF - (top_key & 0xFFFFFFFF)
        top = tl.load(scores + wanted, mask=in_s & (wanted < num_blocks), other=neg_inf)
        wanted_ok = in_s & (top > neg_inf)
        threshold = tl.min(tl.where(in_s, top_key, 0x7FFFFFFFFFFFFFFF), axis=0)  # the S-th key
        hit_slot = tl.load(block_slot + wanted, mask=wanted_ok, other=-1)
        miss = wanted_ok & (hit_slot < 0)

        # 2. Residents: kept iff among the wanted (their key reaches the S-th key) and choosable.
        resident = tl.load(slot_block + j, mask=in_s, other=-1)
        res_ok = in_s & (resident >= 0) & (resident < num_blocks)
        current = tl.load(scores + tl.maximum(resident, 0), mask=res_ok, other=neg_inf)
        if KEEP:  # every resident ranks with its bonus (the order among them is that of `current * keep`)
            current = current * keep
        res_key = (_ordered(current).to(tl.int64) << 32) | (0x7FFFFFFF - resident)
        kept = res_ok & (res_key >= threshold) & (current > neg_inf)
        old_score = tl.load(slot_score + j, mask=in_s, other=neg_inf)

        # 3. Eviction order (ascending key, lower slot first on ties; padding slots last) and output order.
        evict = tl.where(kept, pos_inf, tl.where(resident < 0, neg_inf, current))
        evict = tl.where(in_s, evict, pos_inf)
        evict_key = tl.sort((_ordered(evict).to(tl.int64) << 32) | j.to(tl.int64))
        free = evict_key & 0xFFFFFFFF  # free[p]: the slot the p-th entry goes to
        out_key = (tl.where(miss, 0, 1).to(tl.int64) << 62) | (j.to(tl.int64) << 40) | wanted
        out_key = tl.sort(out_key)
        blocks = out_key & 0xFFFFFFFFFF
        valid = ((out_key >> 62) == 0) & in_s
        block_score = tl.load(scores + blocks, mask=in_s, other=neg_inf)
        forced = block_score == pos_inf
        num_forced = tl.sum((valid & forced).to(tl.int32), axis=0)
        valid = valid & (forced | (j < num_forced + max_fetch))
        tl.store(OUT_BLOCKS + row * num_slots + j, blocks, mask=in_s)
        tl.store(OUT_SLOTS + row * num_slots + j, free, mask=in_s)
        tl.store(OUT_VALID + row * num_slots + j, valid.to(tl.int8), mask=in_s)
        if COUNT:
            tl.atomic_add(FETCHED, tl.sum(valid.to(tl.int64), axis=0))

        # 4. Table update: the misses into the freed slots, then every slot's score from the new residents.
        old = tl.load(slot_block + free, mask=in_s, other=-1)
        tl.debug_barrier()  # every thread has read the old table before any writes it
        tl.store(block_slot + old, -1, mask=valid & (old >= 0))
        tl.store(block_slot + blocks, free, mask=valid)
        tl.store(slot_block + free, blocks, mask=valid)
        tl.debug_barrier()
        now = tl.load(slot_block + j, mask=in_s, other=-1)
        fresh = tl.load(scores + tl.maximum(now, 0), mask=in_s & (now >= 0) & (now < num_blocks), other=neg_inf)
        tl.store(slot_score + j, tl.where(now >= num_blocks, old_score, fresh), mask=in_s)


def supported(num_blocks: int, num_slots: int) -> bool:
    """Whether `plan_blocks` handles a table of `num_blocks` scored blocks and `num_slots` slots."""
    return num_blocks <= MAX_BLOCKS and num_slots <= MAX_SLOTS


def plan_blocks(
    scores: torch.Tensor,
    slot_block: torch.Tensor,
    slot_score: torch.Tensor,
    block_slot: torch.Tensor,
    max_fetch: int | None,
    fetched: torch.Tensor | None = None,
    keep_margin: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Make the top-``S`` blocks by `scores` resident and return the fetch plan, in one launch.

    Parameters
    ----------
    scores : (B, H_kv, NB) float32
        Importance per logical block: ``+inf`` must be resident, ``-inf`` must not be chosen.
    slot_block, slot_score : (B, H_kv, S + 1) long / float32; block_slot : (B, H_kv, NB_cap + 1) long, ``NB_cap >=
        NB``. The residency table (`oasis_hf.cache.block_table.BlockTable`), contiguous, updated in place.
    max_fetch : int | None
        Cap on the misses fetched that are not ``+inf`` (best first); the least important residents are evicted.
    fetched : (1,) int64 or None
        A counter the number of blocks to fetch is added to (device-side statistics, no synchronisation).
    keep_margin : float
        Hysteresis (`OasisConfig.keep_margin`): blocks resident before the plan rank at ``1 + keep_margin`` times
        their score (`keep_residents`: a bonus for the non-negative scores the selectors make); the slots keep the
        scores themselves.

    Returns
    -------
    blocks, slots, valid : each (B, H_kv, S): copy block ``blocks[j]`` into slot ``slots[j]`` where ``valid[j]``.
    Identical to `plan_blocks_ref` (ties broken by index); enqueued on the current stream, capturable.
    """
    batch, heads, num_blocks = scores.shape
    num_slots = slot_block.shape[-1] - 1
    if not supported(num_blocks, num_slots):
        raise ValueError(
            f"plan_blocks: {num_blocks} blocks / {num_slots} slots exceed the kernel's {MAX_BLOCKS} / {MAX_SLOTS}; "
            "use plan_blocks_ref (BlockTable.plan does so automatically)"
        )
    if not num_slots <= num_blocks <= block_slot.shape[-1] - 1:
        raise ValueError(
            f"plan_blocks: scores cover {num_blocks} blocks; need slots ({num_slots}) <= that <= the blocks "
            f"block_slot addresses ({block_slot.shape[-1] - 1})"
        )
    for name, tensor in (("slot_block", slot_block), ("slot_score", slot_score), ("block_slot", block_slot)):
        if not tensor.is_contiguous():
            raise ValueError(f"plan_blocks: {name} must be contiguous")
    if scores.dtype != torch.float32:
        raise ValueError(f"plan_blocks: scores must be float32, got {scores.dtype}")
    check_keep_margin(keep_margin)
    scores = scores.contiguous()
    sp = max(2, triton.next_power_of_2(num_slots))
    nbp = max(2, triton.next_power_of_2(num_blocks))
    out_blocks = torch.empty((batch, heads, num_slots), dtype=torch.long, device=scores.device)
    out_slots = torch.empty_like(out_blocks)
    out_valid = torch.empty((batch, heads, num_slots), dtype=torch.bool, device=scores.device)
    scratch = torch.empty((batch * heads, sp), dtype=torch.int32, device=scores.device)
    cap = num_slots if max_fetch is None else min(int(max_fetch), num_slots)
    _plan_blocks_kernel[(batch * heads,)](
        scores, slot_block, slot_score, block_slot, out_blocks, out_slots, out_valid.view(torch.int8),
        fetched if fetched is not None else out_blocks, scratch, num_blocks, num_slots, slot_block.stride(-2),
        block_slot.stride(-2), cap, 1.0 + keep_margin, COUNT=fetched is not None, KEEP=bool(keep_margin), NBP=nbp,
        SP=sp,
        num_warps=4 if nbp <= 1024 else (8 if nbp <= 4096 else 16),
    )
    return out_blocks, out_slots, out_valid
