"""The new tokens of a decode step in one launch each: into the pool with their bookkeeping, and to host memory.

A decode / verification forward brings ``T`` new tokens per (sequence, KV head). `append_tokens` does the pool's
bookkeeping for them, one program per (sequence, KV head) (`append_program`, which `sparse_attention` also runs in
the launch that merges its splits, after the attention has read the pool):

1. slot allocation: the blocks the tokens touch that are not resident yet (a new block starts every ``BS`` tokens)
   take the cheapest slots (empty first, then the least important unpinned resident; sinks, the recent window and
   the touched blocks are pinned), evicting what those slots held from the table;
2. the tokens' K and V go into their slots;
3. the touched blocks' summaries (mean key, per-channel bounds) are recomputed, from the pool block merged with the
   new rows in registers (no read-after-write through memory), and for a ``quantized`` summary every key code of
   those blocks against their new bounds.

In PyTorch that is about 60 small kernels (gathers, a top-k, scatters, index arithmetic, a masked mean); inside a
captured CUDA graph each still costs a few microseconds, which made the bookkeeping around the attention the
largest part of an OasisKV decode step.

`write_tokens` is the write-back of the same rows into one host store segment (pinned memory, written through
unified addressing), offsets computed in the kernel from the step's start position.

Twins: `append_tokens_ref`, `write_tokens_ref` (``oasis_hf.kernels.ref``).
"""

from __future__ import annotations

import torch

from oasis_hf.kernels._tiles import store_block_summaries
from oasis_hf.kernels.ref import CODE_BITS, CODES_PER_BYTE, SUMMARY_LAYOUT, AppendState

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    append_program = None  # importable without Triton; only the Triton kernels use it

#: The runtime integers of `append_program` left unspecialised (a kernel that calls it lists them too).
APPEND_DYNAMIC = ["num_slots", "stride_slot_row", "stride_block_row", "sink_blocks", "recent_blocks"]


if triton is not None:

    @triton.jit
    def _ordered(x):
        # float32 -> int32 with the same order under signed comparison (-0.0 folded into +0.0 first)
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def append_program(
        bh, start, K, V, POOL_K, POOL_V, SLOT_BLOCK, SLOT_SCORE, BLOCK_SLOT, SUMMARY, KV_START, CODES,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_pb, stride_ph, stride_ps,
        stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
        num_slots, stride_slot_row, stride_block_row, sink_blocks, recent_blocks,
        H_KV: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SP: tl.constexpr, WIDTH: tl.constexpr,
        MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr, QUANT: tl.constexpr,
        BITS: tl.constexpr, PER_BYTE: tl.constexpr, EVICT_OLDEST: tl.constexpr,
    ):  # fmt: skip
        """The append of (sequence, KV head) `bh`'s new tokens at positions ``start ..`` (an int64 scalar): one
        program's work of `append_tokens`, also run by `sparse_attention`'s merge launch."""
        b = bh // H_KV
        h = bh % H_KV
        row = bh.to(tl.int64)
        pos_inf = float("inf")
        end = start + NUM_TOKENS
        first = start // BLOCK_SIZE
        last = (end - 1) // BLOCK_SIZE
        num_blocks = last + 1
        kv0 = tl.load(KV_START + b).to(tl.int64)
        first_real = kv0 // BLOCK_SIZE
        slot_block = SLOT_BLOCK + row * stride_slot_row
        slot_score = SLOT_SCORE + row * stride_slot_row
        block_slot = BLOCK_SLOT + row * stride_block_row

        # Eviction keys of the S slots: pinned (sink, recent, touched) never, empty first, then by score, lower slot
        # first on ties; padding entries past S last.
        j = tl.arange(0, SP)
        in_s = j < num_slots
        resident = tl.load(slot_block + j, mask=in_s, other=-1)
        score = tl.load(slot_score + j, mask=in_s, other=float("-inf"))
        sink = (resident >= first_real) & (resident < first_real + sink_blocks)
        pinned = (resident >= 0) & (sink | (resident >= tl.minimum(num_blocks - recent_blocks, first)))
        if EVICT_OLDEST:  # StreamingLLM: the oldest unpinned block goes, whatever its score
            finite = resident.to(tl.float32)
        else:  # +inf scores rank last among the evictable, as FLT_MAX
            finite = tl.minimum(score, 3.4028234663852886e38)
        evict = tl.where(pinned, pos_inf, tl.where(resident < 0, float("-inf"), finite))
        taken = 0x7FFFFFFFFFFFFFFF
        ekey = tl.where(in_s, (_ordered(evict).to(tl.int64) << 32) | j.to(tl.int64), taken)

        rows = tl.arange(0, BLOCK_SIZE)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        k_src = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
        v_src = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        pool_base = b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
        summary_base = b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
        for i in tl.static_range(WIDTH):
            # Candidate block i. No store of an earlier candidate touches what this one reads: those write the
            # entries of an evicted block (not pinned, so not this one) and of the earlier candidate.
            block = first + i
            live = block <= last
            current = tl.load(block_slot + tl.minimum(block, last))
            fresh = live & (current < 0)
            best = tl.min(ekey, axis=0)
            slot = best & 0xFFFFFFFF
            old = tl.sum(tl.where(j == slot, resident, 0), axis=0)
            tl.store(block_slot + old, -1, mask=fresh & (old >= 0))
            tl.store(slot_block + slot, block, mask=fresh)
            tl.store(slot_score + slot, pos_inf, mask=fresh)
            tl.store(block_slot + block, slot, mask=fresh)
            ekey = tl.where((j == slot) & fresh, taken, ekey)
            held = tl.where(fresh, slot, current)

            # The block's rows: the new tokens from K/V, the rest from the pool; write the new rows. (Masks of rows
            # and dims come from vector comparisons: the interpreter turns `scalar & vector` into integers.)
            pos = block * BLOCK_SIZE + rows
            live_rows = pos < num_blocks * BLOCK_SIZE  # rows of a block <= last
            new = (pos >= start) & (pos < end)
            tok = tl.where(new, pos - start, 0)
            old_rows = live_rows & ~new
            m_new = new[:, None] & dim_ok[None, :]
            m_old = old_rows[:, None] & dim_ok[None, :]
            offs = pool_base + held * stride_ps + rows[:, None] * HEAD_DIM + dims[None, :]
            k = tl.where(new[:, None], tl.load(k_src + tok[:, None] * stride_kt + dims[None, :], mask=m_new, other=0.0),
                         tl.load(POOL_K + offs, mask=m_old, other=0.0))
            tl.store(POOL_K + offs, k.to(POOL_K.dtype.element_ty), mask=m_new)
            v = tl.load(v_src + tok[:, None] * stride_vt + dims[None, :], mask=m_new, other=0.0)
            tl.store(POOL_V + offs, v.to(POOL_V.dtype.element_ty), mask=m_new)

            # Its summaries over the real, written tokens (float32, zero when empty), and a quantized one's codes.
            ok = (pos < end) & (pos >= kv0)
            live_dims = dim_ok & ((block + dims * 0) <= last)
            store_block_summaries(
                k.to(POOL_K.dtype.element_ty).to(tl.float32), ok, SUMMARY, CODES, summary_base + block * HEAD_DIM,
                b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch, block, rows, dims, live_dims, live_rows,
                stride_sn, HEAD_DIM, BLOCK_D, BLOCK_SIZE, MEAN_AT, LO_AT, HI_AT, QUANT, BITS, PER_BYTE,
            )  # fmt: skip

    @triton.jit(do_not_specialize=APPEND_DYNAMIC)
    def _append_tokens_kernel(
        K, V, START, POOL_K, POOL_V, SLOT_BLOCK, SLOT_SCORE, BLOCK_SLOT, SUMMARY, KV_START, CODES,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_pb, stride_ph, stride_ps,
        stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
        num_slots, stride_slot_row, stride_block_row, sink_blocks, recent_blocks,
        H_KV: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SP: tl.constexpr, WIDTH: tl.constexpr,
        MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr, QUANT: tl.constexpr,
        BITS: tl.constexpr, PER_BYTE: tl.constexpr, EVICT_OLDEST: tl.constexpr,
    ):  # fmt: skip
        append_program(
            tl.program_id(0), tl.load(START).to(tl.int64), K, V, POOL_K, POOL_V, SLOT_BLOCK, SLOT_SCORE, BLOCK_SLOT,
            SUMMARY, KV_START, CODES, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
            stride_pb, stride_ph, stride_ps, stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
            num_slots, stride_slot_row, stride_block_row, sink_blocks, recent_blocks,
            H_KV, NUM_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_SIZE, SP, WIDTH, MEAN_AT, LO_AT, HI_AT, QUANT, BITS, PER_BYTE,
            EVICT_OLDEST,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["first_block", "seg_rows"])
    def _write_tokens_kernel(
        K, V, START, DST_K, DST_V,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        first_block, seg_rows,
        H_KV: tl.constexpr, NUM_TOKENS: tl.constexpr, T_P: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H_KV
        h = bh % H_KV
        t = tl.arange(0, T_P)
        dims = tl.arange(0, BLOCK_D)
        local = tl.load(START).to(tl.int64) + t - first_block * BLOCK_SIZE
        inside = (t < NUM_TOKENS) & (local >= 0) & (local < seg_rows)
        mask = inside[:, None] & (dims < HEAD_DIM)[None, :]
        dst = (bh * seg_rows + local)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K + b * stride_kb + h * stride_kh + t[:, None] * stride_kt + dims[None, :], mask=mask)
        v = tl.load(V + b * stride_vb + h * stride_vh + t[:, None] * stride_vt + dims[None, :], mask=mask)
        tl.store(DST_K + dst, k.to(DST_K.dtype.element_ty), mask=mask)
        tl.store(DST_V + dst, v.to(DST_V.dtype.element_ty), mask=mask)


def _check_rows(name: str, tensor: torch.Tensor) -> None:
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (strides {tensor.stride()})")


def append_tokens(
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_block: torch.Tensor,
    slot_score: torch.Tensor,
    block_slot: torch.Tensor,
    summaries: torch.Tensor,
    kv_start: torch.Tensor,
    *,
    kind: str,
    sink_blocks: int,
    recent_blocks: int,
    codes: torch.Tensor | None = None,
    evict_oldest: bool = False,
) -> None:
    """Slots, pool rows, table entries and summaries for a forward's ``T`` new tokens, in one launch.

    Parameters
    ----------
    key, value : (B, H_kv, T, D) the new tokens at positions ``start .. start + T - 1``; last dim contiguous (any
        other strides, e.g. the transposed projections of a model).
    start : 0-d int64 tensor on the pool's device (read on the device: a captured graph replays at any position).
    pool_k, pool_v : (B, H_kv, S, BS, D), each block contiguous.
    slot_block, slot_score : (B, H_kv, S + 1) int64 / float32; block_slot : (B, H_kv, NB_cap + 1) int64: the
        residency table, contiguous, updated in place.
    summaries : (n, B, H_kv, NB_cap, D) in the layout of `kind` (`SUMMARY_LAYOUT`), contiguous, updated in place.
    kv_start : (B,) int64 first real position.
    sink_blocks, recent_blocks : the config's geometry (`OasisConfig.sink_blocks`, `.recent_blocks`).
    codes : (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8, contiguous: a ``quantized`` summary's key codes
        (required for it), updated in place.
    evict_oldest : a new block takes the slot of the oldest unpinned block (the lowest block index) instead of the
        lowest-scored one: the ``static`` selector's sinks-plus-latest set, kept without a selection in the step.

    Same effect as `append_tokens_ref` (table entries identical; summaries up to float32 summation order).
    Enqueued on the current stream; no host synchronisation, capturable.
    """
    args, meta = append_launch(key, value, pool_k, pool_v, slot_block, AppendState(
        slot_score, block_slot, summaries, kind, sink_blocks, recent_blocks, codes, evict_oldest), kv_start)
    _append_tokens_kernel[(key.shape[0] * key.shape[1],)](args[0], args[1], start, *args[2:], **meta, num_warps=4)


def append_launch(key: torch.Tensor, value: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                  slot_block: torch.Tensor, state: AppendState, kv_start: torch.Tensor) -> tuple[tuple, dict]:
    """Check `append_tokens`'s arguments and return `append_program`'s runtime arguments after ``bh, start``
    (K and V first) and its constants: shared by `append_tokens` and `sparse_attention`'s merge launch."""
    batch, heads, num_tokens, head_dim = key.shape
    block_size = pool_k.shape[3]
    num_slots = slot_block.shape[-1] - 1
    if value.shape != key.shape or pool_k.shape != pool_v.shape or pool_k.shape[:2] != (batch, heads):
        raise ValueError(f"append_tokens: key {tuple(key.shape)}, value {tuple(value.shape)} and pool "
                         f"{tuple(pool_k.shape)} disagree")
    for name, tensor in (("key", key), ("value", value)):
        _check_rows(f"append_tokens: {name}", tensor)
    for name, tensor in (("pool_k", pool_k), ("pool_v", pool_v)):
        if tensor.stride(3) != head_dim or tensor.stride(4) != 1 or tensor.stride() != pool_k.stride():
            raise ValueError(f"append_tokens: each block of {name} must be contiguous (BS, D), both pools alike")
    summaries, codes, kind = state.summaries, state.codes, state.kind
    for name, tensor in (("slot_block", slot_block), ("slot_score", state.slot_score),
                         ("block_slot", state.block_slot), ("summaries", summaries)):
        if not tensor.is_contiguous():
            raise ValueError(f"append_tokens: {name} must be contiguous")
    layout = SUMMARY_LAYOUT[kind]
    if summaries.shape[:3] != (len(layout), batch, heads) or summaries.shape[-1] != head_dim:
        raise ValueError(f"append_tokens: summaries {tuple(summaries.shape)} are not {kind!r} summaries of this pool")
    quant = kind == "quantized"
    if quant and (codes is None or not codes.is_contiguous() or codes.dtype != torch.uint8 or codes.shape != (
            batch, heads, summaries.shape[3], block_size, head_dim // CODES_PER_BYTE)):
        raise ValueError(f"append_tokens: a 'quantized' summary needs contiguous uint8 codes of shape (B, H_kv, "
                         f"NB_cap, BS, D // {CODES_PER_BYTE}), got {None if codes is None else tuple(codes.shape)}")
    args = (
        key, value, pool_k, pool_v, slot_block, state.slot_score, state.block_slot, summaries,
        kv_start.to(torch.int64), codes if quant else summaries,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2),
        summaries.stride(0), summaries.stride(1), summaries.stride(2),
        codes.stride(0) if quant else 0, codes.stride(1) if quant else 0,
        num_slots, slot_block.stride(-2), state.block_slot.stride(-2), state.sink_blocks, state.recent_blocks,
    )  # fmt: skip
    meta = dict(
        H_KV=heads, NUM_TOKENS=num_tokens, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, SP=max(2, triton.next_power_of_2(num_slots)),
        WIDTH=-(-(num_tokens - 1) // block_size) + 1,
        MEAN_AT=layout.index("mean") if "mean" in layout else -1,
        LO_AT=layout.index("lo") if "lo" in layout else -1,
        HI_AT=layout.index("hi") if "hi" in layout else -1,
        QUANT=quant, BITS=CODE_BITS, PER_BYTE=CODES_PER_BYTE, EVICT_OLDEST=state.evict_oldest,
    )  # fmt: skip
    return args, meta


def write_tokens(
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    first_block: int,
) -> None:
    """Write new tokens into one host store segment, in one launch (K and V together).

    Parameters
    ----------
    key, value : (B, H_kv, T, D) CUDA tensors, last dim contiguous; positions ``start .. start + T - 1``.
    start : 0-d int64 tensor on their device.
    dst_k, dst_v : (B, H_kv, NB_seg, BS, D) contiguous segment tensors (pinned host memory, written through unified
        addressing, or device memory) holding logical blocks ``first_block ..``; rows outside it are skipped.

    Enqueued on the current stream; no host synchronisation, capturable.
    """
    batch, heads, num_tokens, head_dim = key.shape
    if value.shape != key.shape or dst_k.shape != dst_v.shape or dst_k.shape[:2] != (batch, heads):
        raise ValueError(f"write_tokens: key {tuple(key.shape)} and segment {tuple(dst_k.shape)} disagree")
    for name, tensor in (("key", key), ("value", value)):
        _check_rows(f"write_tokens: {name}", tensor)
    for name, tensor in (("dst_k", dst_k), ("dst_v", dst_v)):
        if not tensor.is_contiguous():
            raise ValueError(f"write_tokens: {name} must be contiguous")
        if tensor.device.type == "cpu" and key.is_cuda and not tensor.is_pinned():
            raise ValueError(f"write_tokens: {name} is pageable host memory, which the GPU cannot address; "
                             "allocate it with pin_memory=True (OasisConfig.pin_host_memory)")
    block_size = dst_k.shape[3]
    _write_tokens_kernel[(batch * heads,)](
        key, value, start, dst_k, dst_v,
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        first_block, dst_k.shape[2] * block_size,
        H_KV=heads, NUM_TOKENS=num_tokens, T_P=max(2, triton.next_power_of_2(num_tokens)), HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
    )  # fmt: skip
