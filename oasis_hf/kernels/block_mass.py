"""Exact causal attention mass per block in two launches: the prefill window's first selection without its
float32 temporaries.

The first selection after a prefill ranks blocks by the exact softmax attention of the prompt's last ``W``
queries (`OasisConfig.prefill_window_tokens`). In PyTorch (`block_mass_ref`) that is a float32 GEMM of the
``G * W`` rows of each GQA group against every key, a mask, a softmax and a sum, each a pass over a
``(B, H_kv, G * W, N)`` float32 tensor: at batch 8 x 16k tokens on Qwen2.5-1.5B about 1.2 ms per layer, the
largest share of what OasisKV's prefill adds to a dense one. Here the keys are read twice and nothing of that
size is written:

1. ``_stats``: one program per (sequence, KV head, split of the keys) walks its keys in tiles against each tile of
   rows, with an online softmax, and writes every row's running max and sum over its split;
2. the splits' maxima and sums are merged per row (a few small PyTorch ops over ``(B * H_kv, splits, rows)``);
3. ``_tokens``: the same programs recompute their logits and write each key's probability summed over the rows;
   the per-token masses are summed per block (`token_mass_per_block`, shared with the twin).

Logits are computed from the inputs' dtype with float32 accumulation (bf16 products are exact in float32), so the
masses equal the twin's up to the order of the sums. Twin: `block_mass_ref` (``oasis_hf.kernels.ref``).
"""

from __future__ import annotations

import math

import torch

from oasis_hf.kernels.backend import INTERPRET, sm_count
from oasis_hf.kernels.ref import token_mass_per_block

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

#: Keys per tile of the walk (a multiple of every split's length).
_BLOCK_N = 64


if triton is not None:

    @triton.jit
    def _program(KV_START, num_keys, keys_per_split, H_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
        """This program's (sequence, KV head) ``bh = b * H_kv + h`` and split: (bh, split, b, h, the sequence's
        first real key, head dims and their validity, its keys ``n_lo .. n_hi - 1``)."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        dims = tl.arange(0, BLOCK_D)
        n_lo = split * keys_per_split
        return (bh, split, b, bh % H_KV, tl.load(KV_START + b), dims, dims < HEAD_DIM, n_lo,
                tl.minimum(n_lo + keys_per_split, num_keys))

    @triton.jit
    def _row_tile(Q, QPOS, b, h, r0, stride_qb, stride_qh, stride_qt, num_rows, num_tokens, dims, dim_ok,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
        """Rows ``r0 .. r0 + BLOCK_M - 1`` of the group (row ``m = g * T + t``: query head ``h * G + g``, token
        ``t``): the (BLOCK_M, BLOCK_D) query tile, the rows' positions (-1 past the last row) and their validity."""
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        g = rows // num_tokens
        t = rows % num_tokens
        q = tl.load(Q + b.to(tl.int64) * stride_qb + (h * GROUP + g)[:, None] * stride_qh + t[:, None] * stride_qt
                    + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        q_pos = tl.load(QPOS + t, mask=row_ok, other=-1)
        return q, q_pos, rows, row_ok

    @triton.jit
    def _logits(q, K, b, h, cols, n_hi, kv_start, q_pos, row_ok, stride_kb, stride_kh, stride_kn, dims, dim_ok,
                SCALE: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """(BLOCK_M, BLOCK_N) scaled logits of the rows against keys `cols`, -inf where a row may not see a key."""
        k = tl.load(K + b.to(tl.int64) * stride_kb + h * stride_kh + cols[:, None].to(tl.int64) * stride_kn
                    + dims[None, :], mask=(cols < n_hi)[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        if IEEE:  # float32 operands on the GPU: no silent tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE
        else:
            s = tl.dot(q, tl.trans(k)) * SCALE
        allowed = ((cols < n_hi) & (cols >= kv_start))[None, :] & (cols[None, :] <= q_pos[:, None]) & row_ok[:, None]
        return tl.where(allowed, s, float("-inf"))

    # The lengths are not specialised (Triton compiles a variant per "divisible by 16" / "equals 1" pattern of its
    # integer arguments): every prompt length would otherwise pick one of several variants.
    _SIZES = ["num_keys", "keys_per_split", "num_rows", "num_tokens", "num_splits"]

    @triton.jit(do_not_specialize=_SIZES)
    def _stats_kernel(Q, K, QPOS, KV_START, M_PART, L_PART, num_keys, keys_per_split, num_rows, num_tokens,
                      num_splits, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kn,
                      H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                      IEEE: tl.constexpr):  # fmt: skip
        bh, split, b, h, kv_start, dims, dim_ok, n_lo, n_hi = _program(KV_START, num_keys, keys_per_split, H_KV,
                                                                        HEAD_DIM, BLOCK_D)
        for r0 in range(0, num_rows, BLOCK_M):
            q, q_pos, rows, row_ok = _row_tile(Q, QPOS, b, h, r0, stride_qb, stride_qh, stride_qt, num_rows,
                                               num_tokens, dims, dim_ok, GROUP, BLOCK_M, DOT_FP32)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            for n0 in range(n_lo, n_hi, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                s = _logits(q, K, b, h, cols, n_hi, kv_start, q_pos, row_ok, stride_kb, stride_kh, stride_kn, dims,
                            dim_ok, SCALE, DOT_FP32, IEEE)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
                m_i = m_new
            part = (bh * num_splits + split) * num_rows + rows
            tl.store(M_PART + part, m_i, mask=row_ok)
            tl.store(L_PART + part, l_i, mask=row_ok)

    @triton.jit(do_not_specialize=_SIZES)
    def _tokens_kernel(Q, K, QPOS, KV_START, ROW_MAX, ROW_SUM, MASS, num_keys, keys_per_split, num_rows, num_tokens,
                       num_splits, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kn,
                       H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                       IEEE: tl.constexpr):  # fmt: skip
        bh, split, b, h, kv_start, dims, dim_ok, n_lo, n_hi = _program(KV_START, num_keys, keys_per_split, H_KV,
                                                                        HEAD_DIM, BLOCK_D)
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mass = tl.zeros([BLOCK_N], tl.float32)
            for r0 in range(0, num_rows, BLOCK_M):
                q, q_pos, rows, row_ok = _row_tile(Q, QPOS, b, h, r0, stride_qb, stride_qh, stride_qt, num_rows,
                                                   num_tokens, dims, dim_ok, GROUP, BLOCK_M, DOT_FP32)
                s = _logits(q, K, b, h, cols, n_hi, kv_start, q_pos, row_ok, stride_kb, stride_kh, stride_kn, dims,
                            dim_ok, SCALE, DOT_FP32, IEEE)
                row_max = tl.load(ROW_MAX + bh * num_rows + rows, mask=row_ok, other=0.0)
                row_sum = tl.load(ROW_SUM + bh * num_rows + rows, mask=row_ok, other=0.0)
                inv = tl.where(row_sum > 0, 1.0 / tl.maximum(row_sum, 1e-30), 0.0)  # a row that sees no key adds 0
                p = tl.exp(s - row_max[:, None]) * inv[:, None]  # exp(-inf) = 0 where a row may not see the key
                mass += tl.sum(p, axis=0)
            tl.store(MASS + bh.to(tl.int64) * num_keys + cols, mass, mask=cols < n_hi)


def _keys_per_split(batch_heads: int, num_keys: int, device: torch.device) -> int:
    """Keys per program: about two programs per SM, each over whole tiles (three splits in the interpreter, to
    exercise the merge)."""
    tiles = triton.cdiv(num_keys, _BLOCK_N)
    if device.type != "cuda":
        splits = min(3, tiles)
    else:
        splits = max(1, min(tiles, math.ceil(2 * sm_count(device) / batch_heads)))
    return triton.cdiv(tiles, splits) * _BLOCK_N


def block_mass(
    query: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    kv_start: torch.Tensor,
    block_size: int,
    capacity_blocks: int,
) -> torch.Tensor:
    """Exact causal softmax attention mass per block, summed over a GQA group's query rows (Triton): query (B,
    H_q, T, D), keys (B, H_kv, N, D) -> (B, H_kv, capacity_blocks) float32. Arguments and result as its twin
    `block_mass_ref`, which states them, up to float rounding."""
    batch, num_q_heads, num_tokens, head_dim = query.shape
    _, num_kv_heads, num_keys, _ = keys.shape
    if num_q_heads % num_kv_heads or keys.shape[0] != batch or keys.shape[-1] != head_dim:
        raise ValueError(f"block_mass: query {tuple(query.shape)} and keys {tuple(keys.shape)} do not match")
    query = query if query.stride(-1) == 1 else query.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    if capacity_blocks < -(-num_keys // block_size):
        raise ValueError(f"block_mass: capacity_blocks={capacity_blocks} < the {num_keys} keys' blocks")
    group = num_q_heads // num_kv_heads
    num_rows = group * num_tokens
    dev = query.device
    batch_heads = batch * num_kv_heads
    if num_keys == 0 or num_rows == 0:
        return torch.zeros(batch, num_kv_heads, capacity_blocks, device=dev)
    block_m = max(16, min(64, triton.next_power_of_2(num_rows)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    per_split = _keys_per_split(batch_heads, num_keys, dev)
    splits = triton.cdiv(num_keys, per_split)
    q_pos = q_pos.to(device=dev, dtype=torch.int64).contiguous()
    kv_start = kv_start.to(device=dev, dtype=torch.int64).contiguous()
    fp32 = query.dtype == torch.float32 or keys.dtype == torch.float32
    if query.dtype != keys.dtype:
        query, keys = query.float(), keys.float()
    common = dict(H_KV=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                  BLOCK_M=block_m, BLOCK_N=_BLOCK_N, SCALE=float(scale), DOT_FP32=INTERPRET or fp32,
                  IEEE=not INTERPRET and fp32)
    # The lengths (keys, window, splits) are unspecialised runtime arguments: a new prompt length, or a last prefill
    # chunk shorter than the window, compiles nothing new.
    sizes = (num_keys, per_split, num_rows, num_tokens, splits)
    strides = (query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1), keys.stride(2))
    m_part = torch.empty(batch_heads, splits, num_rows, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    _stats_kernel[(batch_heads, splits)](query, keys, q_pos, kv_start, m_part, l_part, *sizes, *strides, **common)
    row_max = m_part.amax(1)  # (B * H_kv, rows)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = (l_part * torch.exp(m_part - row_max[:, None])).sum(1)
    mass = torch.empty(batch, num_kv_heads, num_keys, device=dev, dtype=torch.float32)
    _tokens_kernel[(batch_heads, splits)](query, keys, q_pos, kv_start, row_max, row_sum, mass, *sizes, *strides,
                                          **common)
    return token_mass_per_block(mass, block_size, capacity_blocks)
