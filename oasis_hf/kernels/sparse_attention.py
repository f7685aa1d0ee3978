"""Sparse attention over the resident KV blocks: decode (T = 1) and multi-token verification (T = 1 + drafts).

Algorithm (split-K flash decoding over a block table):

- one program per (sequence, KV head, split); the ``G * T`` queries of a GQA group form one ``(BLOCK_M, D)`` tile,
  so each resident block is read once for the whole group;
- a split walks its share of the ``S`` slots ``CHUNK`` slots at a time: one iteration gathers the ``CHUNK * BS``
  keys and values of those slots as one tile (their block ids, keys and values loaded together, and the next
  chunk's prefetched by the software pipeline), so a split waits for memory once per chunk, not three times per
  slot; slot ``s`` holds logical block ``slot_block[b, h, s]`` and thus the keys at positions
  ``block * BS + [0, BS)``; keys are masked by validity (``< seq_len``), left padding (``>= kv_start[b]``) and
  causality (key position <= query position, queries sitting at the end of the sequence);
- online softmax in float32; each split writes an unnormalised partial output plus its running max and sum. The
  splits are merged (log-sum-exp weights) straight into the ``(B, T, H_q, D)`` output, by the last split of a
  (sequence, KV head) to finish (an arrival counter; the fused merge) or by a second launch.

How the work is laid out (`Tiling`: chunk, splits per SM, warps, pipeline depth, fused merge) changes float
rounding only; `default_tiling` picks it from the shape, `sparse_attention_tiled` takes it explicitly (the kernel
benchmark sweeps it).

Bytes: each launch reads ``B * H_kv * S * BS * D * 2`` elements of K and V once (plus the queries), so at batch 32
and a 2048-token budget it is bound by HBM bandwidth, not by arithmetic; at batch 1 it is bound by memory latency,
which the chunks and the fused merge cut.

Caution: under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands is wrong (triton-lang/triton#11584), so the
interpreter path upcasts everything to float32 first (`DOT_FP32`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from oasis_hf.kernels._tiles import load_query_tile
from oasis_hf.kernels.backend import INTERPRET

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _merge_rows(O_PART, M_PART, L_PART, OUT, bh, b, h, dims, stride_ob, stride_ot, stride_oh,
                    GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):  # fmt: skip
        """out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the splits s, for the head dims `dims`.

        Every split's partials load at once, as one (SPLITS_P2, BLOCK_M, len(dims)) tile (a loop over the splits
        waits for each load in turn). Loads bypass L1 (``.cg``): other programs wrote them during this launch. Rows
        that see no key are zero."""
        rows = tl.arange(0, BLOCK_M)
        splits = tl.arange(0, SPLITS_P2)
        split_ok = (splits < NUM_SPLITS)[:, None]
        part = (bh * NUM_SPLITS + splits)[:, None] * BLOCK_M + rows[None, :]  # (SPLITS_P2, BLOCK_M)
        m_all = tl.load(M_PART + part, mask=split_ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(m_all, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        weight = tl.exp(m_all - m_safe[None, :])  # 0 for the padding splits and for splits a row saw nothing in
        denom = tl.sum(weight * tl.load(L_PART + part, mask=split_ok, other=0.0, cache_modifier=".cg"), axis=0)
        o_all = tl.load(O_PART + part[:, :, None] * BLOCK_D + dims[None, None, :], mask=split_ok[:, :, None],
                        other=0.0, cache_modifier=".cg")
        acc = tl.sum(weight[:, :, None] * o_all, axis=0)
        out = acc / tl.maximum(denom, 1e-30)[:, None]
        g = rows // NUM_TOKENS
        t = rows % NUM_TOKENS
        ptrs = OUT + b * stride_ob + t[:, None] * stride_ot + (h * GROUP + g)[:, None] * stride_oh + dims[None, :]
        mask = (rows < GROUP * NUM_TOKENS)[:, None] & (dims < HEAD_DIM)[None, :]
        tl.store(ptrs, out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _sparse_attention_kernel(
        Q,
        K,
        V,
        SLOT_BLOCK,
        KV_START,
        O_PART,
        M_PART,
        L_PART,
        ARRIVED,
        OUT,
        SEQ_LEN,
        num_slots,
        slots_per_split,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vs,
        stride_vt,
        stride_tb,
        stride_th,
        stride_ob,
        stride_ot,
        stride_oh,
        H_KV: tl.constexpr,
        GROUP: tl.constexpr,
        NUM_TOKENS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        CHUNK: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        CHUNK_D: tl.constexpr,
        FUSED_MERGE: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        # A constant, not an argument: Inductor types a Python-float argument of a user Triton kernel as fp64 when
        # a compiled model calls this kernel (the dense-graphed baseline does), which would make the scores fp64.
        SCALE: tl.constexpr,
        DOT_FP32: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        h = bh % H_KV
        q, t, row_ok, dims, dim_ok = load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP, NUM_TOKENS,
                                                     HEAD_DIM, BLOCK_D, BLOCK_M, DOT_FP32)
        rows = tl.arange(0, BLOCK_M)  # row m = g * NUM_TOKENS + t
        seq_len = tl.load(SEQ_LEN)  # from device memory, so a captured CUDA graph replays at any length
        q_pos = seq_len - NUM_TOKENS + t  # (BLOCK_M,)
        kv_start = tl.load(KV_START + b)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs_n = tl.arange(0, CHUNK * BLOCK_SIZE)  # key n of a chunk: token n % BS of its slot n // BS
        chunk_slot = offs_n // BLOCK_SIZE
        tok = offs_n % BLOCK_SIZE
        table = SLOT_BLOCK + b.to(tl.int64) * stride_tb + h * stride_th
        k_base = K + b.to(tl.int64) * stride_kb + h * stride_kh + tok[:, None] * stride_kt + dims[None, :]
        v_base = V + b.to(tl.int64) * stride_vb + h * stride_vh + tok[:, None] * stride_vt + dims[None, :]

        slot_lo = split * slots_per_split
        slot_hi = tl.minimum(slot_lo + slots_per_split, num_slots)
        for first in tl.range(slot_lo, slot_hi, CHUNK, num_stages=NUM_STAGES):
            slot = first + chunk_slot
            in_split = slot < slot_hi
            block = tl.load(table + slot, mask=in_split, other=-1).to(tl.int64)
            key_pos = block * BLOCK_SIZE + tok
            key_ok = in_split & (block >= 0) & (key_pos >= kv_start) & (key_pos < seq_len)  # empty slot: block -1
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_base + slot[:, None].to(tl.int64) * stride_ks, mask=kv_mask, other=0.0)
            v = tl.load(v_base + slot[:, None].to(tl.int64) * stride_vs, mask=kv_mask, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
            if IEEE:  # float32 operands on the GPU: no silent tf32
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE  # (BLOCK_M, CHUNK * BLOCK_SIZE)
            else:
                s = tl.dot(q, tl.trans(k)) * SCALE
            allowed = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            elif DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        part = (bh * NUM_SPLITS + split) * BLOCK_M
        tl.store(O_PART + (part + rows)[:, None] * BLOCK_D + dims[None, :], acc)
        tl.store(M_PART + part + rows, m_i)
        tl.store(L_PART + part + rows, l_i)
        if FUSED_MERGE:
            # The last split of this (sequence, KV head) to arrive merges them all. Every thread's partials are
            # written before the counter moves (barrier, then a release); the merging program acquires it.
            tl.debug_barrier()
            arrived = tl.atomic_add(ARRIVED + bh, 1, sem="acq_rel")
            if arrived == NUM_SPLITS - 1:
                for c in tl.static_range(BLOCK_D // CHUNK_D):
                    _merge_rows(O_PART, M_PART, L_PART, OUT, bh, b, h, c * CHUNK_D + tl.arange(0, CHUNK_D),
                                stride_ob, stride_ot, stride_oh, GROUP, NUM_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_M,
                                NUM_SPLITS, SPLITS_P2)

    @triton.jit
    def _merge_splits_kernel(
        O_PART, M_PART, L_PART, OUT,
        stride_ob, stride_ot, stride_oh,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):  # fmt: skip
        # The second launch of the unfused merge: one program per (sequence, KV head) and CHUNK_D head dims (at
        # batch 1 there are only H_kv of the former).
        bh = tl.program_id(0)
        dims = tl.program_id(1) * CHUNK_D + tl.arange(0, CHUNK_D)
        _merge_rows(O_PART, M_PART, L_PART, OUT, bh, bh // H_KV, bh % H_KV, dims, stride_ob, stride_ot, stride_oh,
                    GROUP, NUM_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_M, NUM_SPLITS, SPLITS_P2)


class Tiling(NamedTuple):
    """How `sparse_attention_tiled` lays out its work; any tiling gives the same result up to float rounding."""

    #: Slots one loop iteration gathers (``chunk * BS`` keys per tile).
    chunk: int
    #: Programs per SM the splits aim at (more splits: more memory requests in flight, more partials to merge).
    programs_per_sm: int
    num_warps: int
    #: Software-pipeline depth of the slot loop (1: none).
    num_stages: int
    #: Merge the splits in the last program of each (sequence, KV head) instead of a second launch.
    fused_merge: bool


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiling(batch_heads: int, num_slots: int, block_size: int, num_tokens: int) -> Tiling:
    """The tiling `sparse_attention` runs for ``batch_heads = B * H_kv`` programs' worth of ``num_slots`` slots of
    ``block_size`` tokens and ``num_tokens`` queries per sequence."""
    chunk = max(1, 64 // block_size)
    return Tiling(chunk=chunk, programs_per_sm=2, num_warps=4, num_stages=2, fused_merge=True)


def _num_splits(batch_heads: int, num_slots: int, tiling: Tiling, device: torch.device) -> int:
    """About `tiling.programs_per_sm` programs per SM, each over at least 4 slots and one chunk (more splits cost
    the merge more than they gain)."""
    least = max(4, tiling.chunk)
    if device.type != "cuda":
        return max(1, min(3, math.ceil(num_slots / tiling.chunk)))  # interpreter: exercise the merge, small grid
    wanted = math.ceil(tiling.programs_per_sm * _sm_count(device) / batch_heads)
    return max(1, min(math.ceil(num_slots / least), wanted))


def sparse_attention(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_block: torch.Tensor,
    seq_len: int | torch.Tensor,
    kv_start: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Exact attention of the new queries over the resident blocks (Triton; twin: `sparse_attention_ref`).

    Parameters
    ----------
    query : (B, H_q, T, D)
        Queries of the ``T`` newest tokens, at positions ``seq_len - T .. seq_len - 1``; last dim contiguous.
    pool_k, pool_v : (B, H_kv, S, BS, D)
        Resident blocks, last dim contiguous; slot ``s`` of (b, h) holds logical block ``slot_block[b, h, s]``.
    slot_block : (B, H_kv, S') integer with S' >= S
        Logical block id per slot (negative: empty); columns past ``S`` are ignored.
    seq_len : int or 0-d integer tensor on the query's device
        Tokens in the sequence after this forward (positions are shared across the batch). The kernel reads a
        tensor from device memory, so a CUDA graph captured around this call stays valid as the sequence grows.
    kv_start : (B,) integer
        First real (non-padding) position of each sequence.
    scale : float
        Softmax scale.

    Returns
    -------
    (B, T, H_q, D) tensor in the dtype of `query`.
    """
    batch, num_tokens = query.shape[0], query.shape[2]
    tiling = default_tiling(batch * pool_k.shape[1], pool_k.shape[2], pool_k.shape[3], num_tokens)
    return sparse_attention_tiled(query, pool_k, pool_v, slot_block, seq_len, kv_start, scale, tiling)


def sparse_attention_tiled(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_block: torch.Tensor,
    seq_len: int | torch.Tensor,
    kv_start: torch.Tensor,
    scale: float,
    tiling: Tiling,
) -> torch.Tensor:
    """`sparse_attention` with an explicit `Tiling` (same arguments, same result up to float rounding)."""
    batch, num_q_heads, num_tokens, head_dim = query.shape
    _, num_kv_heads, num_slots, block_size, _ = pool_k.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"sparse_attention: H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}")
    if pool_k.shape != pool_v.shape or pool_k.shape[-1] != head_dim:
        raise ValueError(f"sparse_attention: pool shapes {tuple(pool_k.shape)}/{tuple(pool_v.shape)} != query D")
    for name, tensor in (("query", query), ("pool_k", pool_k), ("pool_v", pool_v)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"sparse_attention: {name} must be contiguous in its last dim")
    if pool_k.stride(3) != head_dim or pool_v.stride(3) != head_dim:
        raise ValueError("sparse_attention: each pool block must be contiguous (BS, D)")
    if tiling.chunk < 1 or tiling.chunk & (tiling.chunk - 1) or tiling.num_stages < 1 or tiling.programs_per_sm < 1:
        raise ValueError(f"sparse_attention: invalid {tiling} (chunk a power of two, stages and programs >= 1)")
    if slot_block.stride(-1) != 1:
        slot_block = slot_block.contiguous()
    group = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group * num_tokens))
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_splits = _num_splits(batch * num_kv_heads, num_slots, tiling, query.device)
    slots_per_split = math.ceil(num_slots / num_splits / tiling.chunk) * tiling.chunk  # whole chunks
    num_splits = math.ceil(num_slots / slots_per_split)
    splits_p2 = max(2, triton.next_power_of_2(num_splits))
    # One merge tile of partials: (splits, rows, CHUNK_D) float32, kept at about 8k elements.
    chunk_d = max(16, min(block_d, 32, triton.next_power_of_2(8192 // (splits_p2 * block_m))))

    dev = query.device
    o_part = torch.empty(batch * num_kv_heads * num_splits * block_m, block_d, device=dev, dtype=torch.float32)
    m_part = torch.empty(batch * num_kv_heads * num_splits * block_m, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    # Arrival counters of the fused merge: zeroed by every call (a memset node inside a captured graph).
    arrived = torch.zeros(batch * num_kv_heads if tiling.fused_merge else 1, device=dev, dtype=torch.int32)
    out = torch.empty(batch, num_tokens, num_q_heads, head_dim, device=dev, dtype=query.dtype)
    kv_start = kv_start.to(device=dev, dtype=torch.int64)
    if isinstance(seq_len, torch.Tensor):
        seq_len = seq_len.to(device=dev, dtype=torch.int64)
    else:
        seq_len = torch.full((), seq_len, dtype=torch.int64, device=dev)  # a fill kernel, no host copy
    grid = (batch * num_kv_heads, num_splits)
    _sparse_attention_kernel[grid](
        query, pool_k, pool_v, slot_block, kv_start, o_part, m_part, l_part, arrived, out,
        seq_len, num_slots, slots_per_split,
        query.stride(0), query.stride(1), query.stride(2),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), pool_k.stride(3),
        pool_v.stride(0), pool_v.stride(1), pool_v.stride(2), pool_v.stride(3),
        slot_block.stride(0), slot_block.stride(1), out.stride(0), out.stride(1), out.stride(2),
        H_KV=num_kv_heads, GROUP=group, NUM_TOKENS=num_tokens, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_SIZE=block_size, CHUNK=tiling.chunk, NUM_SPLITS=num_splits, SPLITS_P2=splits_p2,
        CHUNK_D=chunk_d, FUSED_MERGE=tiling.fused_merge, NUM_STAGES=tiling.num_stages, SCALE=float(scale),
        DOT_FP32=INTERPRET or query.dtype == torch.float32,
        IEEE=not INTERPRET and query.dtype == torch.float32,
        num_warps=tiling.num_warps,
    )  # fmt: skip
    if not tiling.fused_merge:
        _merge_splits_kernel[(batch * num_kv_heads, block_d // chunk_d)](
            o_part, m_part, l_part, out, out.stride(0), out.stride(1), out.stride(2),
            H_KV=num_kv_heads, GROUP=group, NUM_TOKENS=num_tokens, HEAD_DIM=head_dim, BLOCK_D=block_d,
            CHUNK_D=chunk_d, BLOCK_M=block_m, NUM_SPLITS=num_splits, SPLITS_P2=splits_p2,
            num_warps=4 if splits_p2 * block_m * chunk_d <= 8192 else 8,
        )  # fmt: skip
    return out
