"""The delta fetch of one layer-step in one launch: the K and V blocks of a plan, from (pinned) host memory into the
pool slots.

`copy_rows` needs every row's element offset precomputed: a dozen small index kernels per segment before two
launches (K, then V). Here the plan itself is the input, ``blocks``/``slots``/``valid`` (B, H_kv, N) as
`BlockTable.plan` returns them, and each program computes the offsets of its entries, then moves their K and V rows
together (twice the bytes in flight per program, which is what hides PCIe latency with few programs). Persistent
and capped like `copy_rows`, so a background fetch leaves most SMs to the decode step; each (sequence, KV head) row
of the plan is walked only up to its last valid entry (a plan lists the blocks to move first, a handful of its
``S`` entries: walking all of them cost the selection job more than the transfer).
"""

from __future__ import annotations

import torch

from oasis_hf.kernels.backend import sm_count
from oasis_hf.kernels.copy_rows import _TILE_ELEMS

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit(do_not_specialize=["num_rows", "num_per_head", "num_heads", "first_block", "num_src_blocks",
                                   "parts"])
    def _gather_blocks_kernel(
        SRC_K,
        SRC_V,
        DST_K,
        DST_V,
        BLOCKS,
        SLOTS,
        VALID,
        num_rows,
        num_per_head,
        num_heads,
        first_block,
        num_src_blocks,
        parts,
        src_stride_b,
        src_stride_h,
        dst_stride_b,
        dst_stride_h,
        ROW_ELEMS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        NP: tl.constexpr,
    ):
        # Persistent over (row = one (sequence, KV head) of the plan, part) tasks; a task walks its row's entries up to
        # the last valid one only (a plan lists its valid entries first), `parts` tasks sharing a row when there are
        # fewer rows than programs (batch 1).
        pid = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < ROW_ELEMS
        j = tl.arange(0, NP)
        for task in tl.range(pid, num_rows * parts, tl.num_programs(0)):
            row = (task // parts).to(tl.int64)
            part = task % parts
            flags = tl.load(VALID + row * num_per_head + j, mask=j < num_per_head, other=0) != 0
            end = tl.max(tl.where(flags, j + 1, 0), axis=0)  # one past the row's last valid entry
            b, h = row // num_heads, row % num_heads
            for base in tl.range(part * ROWS, end, parts * ROWS):
                index = base + tl.arange(0, ROWS)
                in_row = index < end
                entry = row * num_per_head + index
                block = tl.load(BLOCKS + entry, mask=in_row, other=-1)
                slot = tl.load(SLOTS + entry, mask=in_row, other=0)
                ok = in_row & (tl.load(VALID + entry, mask=in_row, other=0) != 0)
                local = block - first_block
                ok = ok & (local >= 0) & (local < num_src_blocks)
                src = b * src_stride_b + h * src_stride_h + local * ROW_ELEMS
                dst = b * dst_stride_b + h * dst_stride_h + slot * ROW_ELEMS
                mask = ok[:, None] & col_ok[None, :]
                k = tl.load(SRC_K + src[:, None] + cols[None, :], mask=mask)
                v = tl.load(SRC_V + src[:, None] + cols[None, :], mask=mask)
                tl.store(DST_K + dst[:, None] + cols[None, :], k, mask=mask)
                tl.store(DST_V + dst[:, None] + cols[None, :], v, mask=mask)


def _check(src_k, src_v, dst_k, dst_v, blocks, slots, valid) -> None:
    if not (src_k.dtype == src_v.dtype == dst_k.dtype == dst_v.dtype):
        raise ValueError("gather_blocks: the four K/V tensors must share one dtype")
    if src_k.shape != src_v.shape or dst_k.shape != dst_v.shape:
        raise ValueError(f"gather_blocks: K and V shapes differ ({tuple(src_k.shape)} / {tuple(src_v.shape)}, "
                         f"{tuple(dst_k.shape)} / {tuple(dst_v.shape)})")
    if src_k.shape[:2] != dst_k.shape[:2] or src_k.shape[3:] != dst_k.shape[3:]:
        raise ValueError(f"gather_blocks: store {tuple(src_k.shape)} and pool {tuple(dst_k.shape)} disagree on "
                         "(B, H_kv) or the block shape (BS, D)")
    if not (blocks.shape == slots.shape == valid.shape) or blocks.shape[:2] != src_k.shape[:2]:
        raise ValueError(f"gather_blocks: blocks/slots/valid must be (B, H_kv, N) alike, got {tuple(blocks.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(valid.shape)}")
    for name, t in (("src_k", src_k), ("src_v", src_v), ("dst_k", dst_k), ("dst_v", dst_v)):
        if t.stride(2) != t.shape[3] * t.shape[4] or t.stride(3) != t.shape[4] or t.stride(4) != 1:
            raise ValueError(f"gather_blocks: each block of {name} must be contiguous (strides {t.stride()})")


def gather_blocks(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    blocks: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    first_block: int = 0,
    max_programs: int | None = None,
) -> None:
    """``dst[b, h, slots[b,h,j]] = src[b, h, blocks[b,h,j] - first_block]`` for K and V, in one launch.

    Parameters
    ----------
    src_k, src_v : (B, H_kv, NB_src, BS, D)
        A host store segment holding logical blocks ``first_block .. first_block + NB_src - 1`` (pinned CPU memory,
        read through unified addressing, or device memory).
    dst_k, dst_v : (B, H_kv, S, BS, D) the pool (CUDA).
    blocks, slots : (B, H_kv, N) int64; valid : (B, H_kv, N) bool — a plan: entries not valid, or whose block is
        outside this segment, are skipped. Contiguous, on the pool's device.
    first_block : the segment's first logical block.
    max_programs : int | None — most programs along the entries (see `copy_rows`); None: two per SM, each looping
        over its share.

    Enqueued on the current CUDA stream; no host synchronisation, capturable.
    """
    _check(src_k, src_v, dst_k, dst_v, blocks, slots, valid)
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"gather_blocks: max_programs={max_programs} must be a positive int or None")
    for name, tensor in (("src_k", src_k), ("src_v", src_v)):
        if tensor.device.type == "cpu" and blocks.is_cuda and not tensor.is_pinned():
            raise ValueError(f"gather_blocks: {name} is pageable host memory, which the GPU cannot address; "
                             "allocate it with pin_memory=True (OasisConfig.pin_host_memory)")
    batch, heads, per_head = blocks.shape
    if batch * heads * per_head == 0:
        return
    row = src_k.shape[3] * src_k.shape[4]
    block = min(triton.next_power_of_2(row), _TILE_ELEMS // 2)  # K and V tiles in flight together
    rows = max(2, min(_TILE_ELEMS // 2 // block, triton.next_power_of_2(per_head)))
    num_rows = batch * heads
    # The interpreter runs a small persistent grid (it still loops over every entry).
    programs = max_programs or 2 * (sm_count(dst_k.device) if dst_k.is_cuda else 2)
    parts = max(1, min(programs // num_rows, triton.cdiv(per_head, rows)))  # programs sharing a row
    programs = min(programs, num_rows * parts)
    grid = (programs, triton.cdiv(row, block))
    _gather_blocks_kernel[grid](
        src_k, src_v, dst_k, dst_v, blocks.contiguous(), slots.contiguous(), valid.contiguous().view(torch.int8),
        num_rows, per_head, heads, first_block, src_k.shape[2], parts, src_k.stride(0), src_k.stride(1),
        dst_k.stride(0), dst_k.stride(1), ROW_ELEMS=row, ROWS=rows, BLOCK=block,
        NP=max(2, triton.next_power_of_2(per_head)), num_warps=8 if rows * block >= 4096 else 4,
    )
