"""Sparse attention over the resident KV blocks: decode (T = 1) and multi-token verification (T = 1 + drafts).

Algorithm (split-K flash decoding over a block table):

- one program per (sequence, KV head, split); the ``G * T`` queries of a GQA group form one ``(BLOCK_M, D)`` tile,
  so each resident block is read once for the whole group;
- a split walks its share of the ``S`` slots; slot ``s`` holds logical block ``slot_block[b, h, s]`` and thus the
  keys at positions ``block * BS + [0, BS)``; keys are masked by validity (``< seq_len``), left padding
  (``>= kv_start[b]``) and causality (key position <= query position, queries sitting at the end of the sequence);
- online softmax in float32; each split writes an unnormalised partial output plus its running max and sum, and a
  second launch merges the splits (log-sum-exp weights) straight into the ``(B, T, H_q, D)`` output (in PyTorch
  that epilogue was ten small kernels per layer-step). Merging in the same launch instead (the last split of a
  (sequence, KV head) to arrive, counted atomically, merges them all) measured slower on an H100: 10.6 against
  9.4 us per launch at batch 1 with Qwen2.5-1.5B's heads and 64 slots, 12.1 against 10.9 at batch 8; the count
  alone costs about 1 us and one program's merge about 4, what the second launch costs.
- optionally the step's new tokens come from their own ``(B, H_kv, T, D)`` tensors instead of the pool (the pool is
  read below ``seq_len - T``; the last split attends them), and the merge launch gets one more program per
  (sequence, KV head) that appends them (`append_tokens`'s program): the decode step's append costs no launch of
  its own, and the attention need not wait for it.

Bytes: each launch reads ``B * H_kv * S * BS * D * 2`` elements of K and V once (plus the queries), so at batch 32
and a 2048-token budget it is bound by HBM bandwidth, not by arithmetic.

Caution: under ``TRITON_INTERPRET=1`` ``tl.dot`` on bf16 operands is wrong (triton-lang/triton#11584), so the
interpreter path upcasts everything to float32 first (`DOT_FP32`).
"""

from __future__ import annotations

import math

import torch

from oasis_hf.kernels._tiles import load_query_tile
from oasis_hf.kernels.append_tokens import APPEND_DYNAMIC, append_launch, append_program
from oasis_hf.kernels.backend import INTERPRET, sm_count
from oasis_hf.kernels.ref import AppendState, check_new_tokens

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _attend_keys(q, k_ptrs, v_ptrs, key_pos, key_ok, q_pos, row_ok, dim_ok, m_i, l_i, acc, KV_DTYPE: tl.constexpr,
                     SCALE: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """One online-softmax step of the query tile over a tile of keys (`key_ok`: which may be read at all):
        the updated (m_i, l_i, acc). K/V are read in `KV_DTYPE`, the pool's (new tokens are rounded to it as the
        pool would hold them)."""
        k = tl.load(k_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(KV_DTYPE)
        if DOT_FP32:
            k = k.to(tl.float32)
        if IEEE:  # float32 operands on the GPU: no silent tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE  # (BLOCK_M, keys)
        else:
            s = tl.dot(q, tl.trans(k)) * SCALE
        allowed = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(KV_DTYPE)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _sparse_attention_kernel(
        Q, K, V, SLOT_BLOCK, KV_START, O_PART, M_PART, L_PART, SEQ_LEN, NEW_K, NEW_V,
        num_slots, slots_per_split,
        stride_qb, stride_qh, stride_qt,
        stride_kb, stride_kh, stride_ks, stride_kt,
        stride_vb, stride_vh, stride_vs, stride_vt,
        stride_tb, stride_th,
        stride_nkb, stride_nkh, stride_nkt, stride_nvb, stride_nvh, stride_nvt,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        # A constant, not an argument: Inductor types a Python-float argument of a user Triton kernel as fp64 when
        # a compiled model calls this kernel (the dense-graphed baseline does), which would make the scores fp64.
        SCALE: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
        HAS_NEW: tl.constexpr, NEW_P: tl.constexpr,
    ):  # fmt: skip
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
        # With the new tokens given, the pool is read below them only (their rows may not be written yet).
        pool_end = seq_len - NUM_TOKENS if HAS_NEW else seq_len

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        offs_t = tl.arange(0, BLOCK_SIZE)
        kv_dtype = K.dtype.element_ty

        slot_lo = split * slots_per_split
        slot_hi = tl.minimum(slot_lo + slots_per_split, num_slots)
        for slot in range(slot_lo, slot_hi):
            block = tl.load(SLOT_BLOCK + b * stride_tb + h * stride_th + slot).to(tl.int64)
            key_pos = block * BLOCK_SIZE + offs_t
            key_ok = (key_pos >= 0) & (key_pos >= kv_start) & (key_pos < pool_end)  # empty slot: block -1
            k_ptrs = K + b * stride_kb + h * stride_kh + slot * stride_ks + offs_t[:, None] * stride_kt + dims[None, :]
            v_ptrs = V + b * stride_vb + h * stride_vh + slot * stride_vs + offs_t[:, None] * stride_vt + dims[None, :]
            m_i, l_i, acc = _attend_keys(q, k_ptrs, v_ptrs, key_pos, key_ok, q_pos, row_ok, dim_ok, m_i, l_i, acc,
                                         kv_dtype, SCALE, DOT_FP32, IEEE)
        if HAS_NEW:
            if split == NUM_SPLITS - 1:  # the new tokens, in the last split
                j = tl.arange(0, NEW_P)
                key_pos = (seq_len - NUM_TOKENS + j).to(tl.int64)
                key_ok = (j < NUM_TOKENS) & (key_pos >= kv_start)
                k_ptrs = NEW_K + b * stride_nkb + h * stride_nkh + j[:, None] * stride_nkt + dims[None, :]
                v_ptrs = NEW_V + b * stride_nvb + h * stride_nvh + j[:, None] * stride_nvt + dims[None, :]
                m_i, l_i, acc = _attend_keys(q, k_ptrs, v_ptrs, key_pos, key_ok, q_pos, row_ok, dim_ok, m_i, l_i,
                                             acc, kv_dtype, SCALE, DOT_FP32, IEEE)

        part = (bh * NUM_SPLITS + split) * BLOCK_M
        tl.store(O_PART + (part + rows)[:, None] * BLOCK_D + dims[None, :], acc)
        tl.store(M_PART + part + rows, m_i)
        tl.store(L_PART + part + rows, l_i)

    @triton.jit
    def _merge_program(
        bh, chunk, O_PART, M_PART, L_PART, OUT,
        stride_ob, stride_ot, stride_oh,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):  # fmt: skip
        # out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s over the splits s; rows that see no key are zero.
        # One program per (sequence, KV head) and CHUNK_D head dims: at batch 1 there are only H_kv of the former.
        # Every split's partials are loaded at once, as one (SPLITS_P2, BLOCK_M[, CHUNK_D]) tile: a loop over the
        # splits waits for each load in turn, which at 16 splits (batch 1) cost more than the attention itself.
        b = bh // H_KV
        h = bh % H_KV
        rows = tl.arange(0, BLOCK_M)
        dims = chunk * CHUNK_D + tl.arange(0, CHUNK_D)
        splits = tl.arange(0, SPLITS_P2)
        split_ok = (splits < NUM_SPLITS)[:, None]
        part = (bh * NUM_SPLITS + splits)[:, None] * BLOCK_M + rows[None, :]  # (SPLITS_P2, BLOCK_M)
        m_all = tl.load(M_PART + part, mask=split_ok, other=float("-inf"))
        m = tl.max(m_all, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        weight = tl.exp(m_all - m_safe[None, :])  # 0 for the padding splits and for splits a row saw nothing in
        denom = tl.sum(weight * tl.load(L_PART + part, mask=split_ok, other=0.0), axis=0)
        o_all = tl.load(O_PART + part[:, :, None] * BLOCK_D + dims[None, None, :], mask=split_ok[:, :, None],
                        other=0.0)
        acc = tl.sum(weight[:, :, None] * o_all, axis=0)
        out = acc / tl.maximum(denom, 1e-30)[:, None]
        g = rows // NUM_TOKENS
        t = rows % NUM_TOKENS
        ptrs = OUT + b * stride_ob + t[:, None] * stride_ot + (h * GROUP + g)[:, None] * stride_oh + dims[None, :]
        mask = (rows < GROUP * NUM_TOKENS)[:, None] & (dims < HEAD_DIM)[None, :]
        tl.store(ptrs, out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _merge_splits_kernel(
        O_PART, M_PART, L_PART, OUT,
        stride_ob, stride_ot, stride_oh,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):  # fmt: skip
        _merge_program(tl.program_id(0), tl.program_id(1), O_PART, M_PART, L_PART, OUT, stride_ob, stride_ot,
                       stride_oh, H_KV, GROUP, NUM_TOKENS, HEAD_DIM, BLOCK_D, CHUNK_D, BLOCK_M, NUM_SPLITS,
                       SPLITS_P2)

    @triton.jit(do_not_specialize=APPEND_DYNAMIC)
    def _merge_append_kernel(
        O_PART, M_PART, L_PART, OUT, SEQ_LEN,
        stride_ob, stride_ot, stride_oh,
        K, V, POOL_K, POOL_V, SLOT_BLOCK, SLOT_SCORE, BLOCK_SLOT, SUMMARY, KV_START, CODES,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
        stride_pb, stride_ph, stride_ps,
        stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
        num_slots, stride_slot_row, stride_block_row, sink_blocks, recent_blocks,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SP: tl.constexpr, WIDTH: tl.constexpr,
        MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr, QUANT: tl.constexpr,
        BITS: tl.constexpr, PER_BYTE: tl.constexpr, EVICT_OLDEST: tl.constexpr,
    ):  # fmt: skip
        # Programs (bh, 0 .. BLOCK_D / CHUNK_D - 1) merge; program (bh, BLOCK_D / CHUNK_D) appends bh's new tokens.
        # The attention launch before this one has read the pool, so the append may now evict and overwrite.
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        if chunk == BLOCK_D // CHUNK_D:
            append_program(
                bh, tl.load(SEQ_LEN).to(tl.int64) - NUM_TOKENS, K, V, POOL_K, POOL_V, SLOT_BLOCK, SLOT_SCORE,
                BLOCK_SLOT, SUMMARY, KV_START, CODES, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh,
                stride_vt, stride_pb, stride_ph, stride_ps, stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
                num_slots, stride_slot_row, stride_block_row, sink_blocks, recent_blocks,
                H_KV, NUM_TOKENS, HEAD_DIM, BLOCK_D, BLOCK_SIZE, SP, WIDTH, MEAN_AT, LO_AT, HI_AT, QUANT, BITS,
                PER_BYTE, EVICT_OLDEST,
            )  # fmt: skip
        else:
            _merge_program(bh, chunk, O_PART, M_PART, L_PART, OUT, stride_ob, stride_ot, stride_oh, H_KV, GROUP,
                           NUM_TOKENS, HEAD_DIM, BLOCK_D, CHUNK_D, BLOCK_M, NUM_SPLITS, SPLITS_P2)


def _num_splits(batch_heads: int, num_slots: int, device: torch.device) -> int:
    """About two programs per SM, each over at least 4 slots (more splits cost the merge more than they gain)."""
    if device.type != "cuda":
        return min(3, num_slots)  # interpreter: exercise the merge (and its padding to 4 splits), keep the grid small
    sms = sm_count(device)
    return max(1, min(math.ceil(num_slots / 4), math.ceil(2 * sms / batch_heads)))


def sparse_attention(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_block: torch.Tensor,
    seq_len: int | torch.Tensor,
    kv_start: torch.Tensor,
    scale: float,
    *,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    append: AppendState | None = None,
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
    new_key, new_value : (B, H_kv, T, D), optional, last dim contiguous
        The new tokens' K/V: read from here (rounded to the pool's dtype) and the pool only below
        ``seq_len - T``, so the attention does not wait for them to be appended.
    append : AppendState, optional (needs `new_key` / `new_value`)
        Append the new tokens (`append_tokens`: `slot_block` is then the whole (B, H_kv, S + 1) int64 table) in the
        launch that merges the splits, after the attention read the pool: a block the append evicts was still
        attended in this call. One launch fewer per layer-step than `append_tokens` before the attention.

    Returns
    -------
    (B, T, H_q, D) tensor in the dtype of `query`.
    """
    batch, num_q_heads, num_tokens, head_dim = query.shape
    _, num_kv_heads, num_slots, block_size, _ = pool_k.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"sparse_attention: H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}")
    if pool_k.shape != pool_v.shape or pool_k.shape[-1] != head_dim:
        raise ValueError(f"sparse_attention: pool shapes {tuple(pool_k.shape)}/{tuple(pool_v.shape)} != query D")
    check_new_tokens("sparse_attention", query, pool_k, new_key, new_value, append)
    for name, tensor in (("query", query), ("pool_k", pool_k), ("pool_v", pool_v), ("new_key", new_key),
                         ("new_value", new_value)):
        if tensor is not None and tensor.stride(-1) != 1:
            raise ValueError(f"sparse_attention: {name} must be contiguous in its last dim")
    if pool_k.stride(3) != head_dim or pool_v.stride(3) != head_dim:
        raise ValueError("sparse_attention: each pool block must be contiguous (BS, D)")
    if slot_block.stride(-1) != 1:
        if append is not None:
            raise ValueError("sparse_attention: with append=, slot_block is the table it updates: pass it contiguous")
        slot_block = slot_block.contiguous()
    group = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group * num_tokens))
    block_d = max(16, triton.next_power_of_2(head_dim))
    num_splits = _num_splits(batch * num_kv_heads, num_slots, query.device)
    slots_per_split = math.ceil(num_slots / num_splits)
    num_splits = math.ceil(num_slots / slots_per_split)

    dev = query.device
    o_part = torch.empty(batch * num_kv_heads * num_splits * block_m, block_d, device=dev, dtype=torch.float32)
    m_part = torch.empty(batch * num_kv_heads * num_splits * block_m, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    kv_start = kv_start.to(device=dev, dtype=torch.int64)
    if isinstance(seq_len, torch.Tensor):
        seq_len = seq_len.to(device=dev, dtype=torch.int64)
    else:
        seq_len = torch.full((), seq_len, dtype=torch.int64, device=dev)  # a fill kernel, no host copy
    has_new = new_key is not None
    new_k, new_v = (new_key, new_value) if has_new else (query, query)  # never read without HAS_NEW
    grid = (batch * num_kv_heads, num_splits)
    _sparse_attention_kernel[grid](
        query, pool_k, pool_v, slot_block, kv_start, o_part, m_part, l_part, seq_len, new_k, new_v,
        num_slots, slots_per_split,
        query.stride(0), query.stride(1), query.stride(2),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), pool_k.stride(3),
        pool_v.stride(0), pool_v.stride(1), pool_v.stride(2), pool_v.stride(3),
        slot_block.stride(0), slot_block.stride(1),
        new_k.stride(0), new_k.stride(1), new_k.stride(2), new_v.stride(0), new_v.stride(1), new_v.stride(2),
        H_KV=num_kv_heads, GROUP=group, NUM_TOKENS=num_tokens, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, SCALE=float(scale),
        DOT_FP32=INTERPRET or query.dtype == torch.float32,
        IEEE=not INTERPRET and query.dtype == torch.float32,
        HAS_NEW=has_new, NEW_P=max(16, triton.next_power_of_2(num_tokens)),
    )  # fmt: skip

    out = torch.empty(batch, num_tokens, num_q_heads, head_dim, device=dev, dtype=query.dtype)
    splits_p2 = max(2, triton.next_power_of_2(num_splits))
    # One program's tile of partials: (splits, rows, CHUNK_D) float32, kept at about 8k elements.
    chunk_d = max(16, min(block_d, 32, triton.next_power_of_2(8192 // (splits_p2 * block_m))))
    merge = dict(H_KV=num_kv_heads, GROUP=group, NUM_TOKENS=num_tokens, HEAD_DIM=head_dim, BLOCK_D=block_d,
                 CHUNK_D=chunk_d, BLOCK_M=block_m, NUM_SPLITS=num_splits, SPLITS_P2=splits_p2,
                 num_warps=4 if splits_p2 * block_m * chunk_d <= 8192 else 8)
    if append is None:
        _merge_splits_kernel[(batch * num_kv_heads, block_d // chunk_d)](
            o_part, m_part, l_part, out, out.stride(0), out.stride(1), out.stride(2), **merge)
        return out
    args, meta = append_launch(new_key, new_value, pool_k, pool_v, slot_block, append, kv_start)
    for name in ("H_KV", "NUM_TOKENS", "HEAD_DIM", "BLOCK_D"):  # the same shapes, checked by check_new_tokens
        del meta[name]
    _merge_append_kernel[(batch * num_kv_heads, block_d // chunk_d + 1)](
        o_part, m_part, l_part, out, seq_len, out.stride(0), out.stride(1), out.stride(2), *args, **merge, **meta)
    return out
