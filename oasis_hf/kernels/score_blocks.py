"""Block scoring: every block's share of the queries' attention, estimated from one summary key per block.

For each (sequence, KV head) the ``G * T`` query rows of the GQA group form one ``(BLOCK_M, D)`` tile; the kernel
walks the block summaries twice (online max and sum of the softmax over blocks, then the normalised probabilities
summed over the rows), so scoring is one launch that reads the summaries twice instead of a chain of matmul,
mask, softmax and sum kernels with a float32 copy of every summary in between.

One program per (sequence, KV head): at batch 8 and 32k tokens (1,024 blocks of 32, head dim 128) it reads 2 x 256
KiB of summaries per program.
"""

from __future__ import annotations

import torch

from oasis_hf.kernels import INTERPRET
from oasis_hf.kernels._tiles import load_query_tile

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _block_logits(q, S, OK, b, h, n0, num_blocks, stride_sb, stride_sh, stride_sn, stride_okb, scale, row_ok,
                      dims, dim_ok, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_in = cols < num_blocks
        ok = tl.load(OK + b * stride_okb + cols, mask=col_in, other=0) != 0
        s_ptrs = S + b * stride_sb + h * stride_sh + cols[:, None] * stride_sn + dims[None, :]
        s = tl.load(s_ptrs, mask=col_in[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            s = s.to(tl.float32)
        if IEEE:
            logits = tl.dot(q, tl.trans(s), input_precision="ieee") * scale
        else:
            logits = tl.dot(q, tl.trans(s)) * scale
        allowed = row_ok[:, None] & ok[None, :]
        return tl.where(allowed, logits, float("-inf")), allowed, cols, col_in

    @triton.jit
    def _score_blocks_kernel(
        Q, S, OK, OUT,
        num_blocks, scale,
        stride_qb, stride_qh, stride_qt,
        stride_sb, stride_sh, stride_sn,
        stride_okb,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        b = bh // H_KV
        h = bh % H_KV
        q, t, row_ok, dims, dim_ok = load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP, NUM_TOKENS,
                                                     HEAD_DIM, BLOCK_D, BLOCK_M, DOT_FP32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, num_blocks, BLOCK_N):
            logits, allowed, cols, col_in = _block_logits(
                q, S, OK, b, h, n0, num_blocks, stride_sb, stride_sh, stride_sn, stride_okb, scale, row_ok, dims,
                dim_ok, BLOCK_N, DOT_FP32, IEEE,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(logits, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.where(allowed, tl.exp(logits - m_safe[:, None]), 0.0), 1)
            m_i = m_new
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)  # a row with no valid block adds nothing
        for n0 in range(0, num_blocks, BLOCK_N):
            logits, allowed, cols, col_in = _block_logits(
                q, S, OK, b, h, n0, num_blocks, stride_sb, stride_sh, stride_sn, stride_okb, scale, row_ok, dims,
                dim_ok, BLOCK_N, DOT_FP32, IEEE,
            )  # fmt: skip
            p = tl.where(allowed, tl.exp(logits - m_safe[:, None]) * inv[:, None], 0.0)
            tl.store(OUT + bh * num_blocks + cols, tl.sum(p, axis=0), mask=col_in)


def score_blocks(
    query: torch.Tensor,
    summary: torch.Tensor,
    block_ok: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax-over-blocks attention share of every block, summed over the GQA group and the query tokens.

    Parameters
    ----------
    query : (B, H_q, T, D)
        Queries (RoPE applied), last dim contiguous.
    summary : (B, H_kv, NB, D)
        One summary key per block (the block's mean key), last dim contiguous.
    block_ok : (B, NB) bool
        Blocks that may be chosen; the softmax runs over these only.
    scale : float
        Softmax scale of the attention.

    Returns
    -------
    (B, H_kv, NB) float32: for each query row ``r`` of the group, ``softmax_n(q_r . s_n * scale)`` over the allowed
    blocks, summed over the ``G * T`` rows; 0 for blocks outside `block_ok`.
    """
    batch, num_q_heads, num_tokens, head_dim = query.shape
    _, num_kv_heads, num_blocks, _ = summary.shape
    if num_q_heads % num_kv_heads or summary.shape[0] != batch or summary.shape[-1] != head_dim:
        raise ValueError(f"score_blocks: query {tuple(query.shape)} does not match summary {tuple(summary.shape)}")
    if query.stride(-1) != 1 or summary.stride(-1) != 1:
        raise ValueError("score_blocks: query and summary must be contiguous in their last dim")
    if block_ok.shape != (batch, num_blocks):
        raise ValueError(f"score_blocks: block_ok must be (B, NB) = {(batch, num_blocks)}, got {tuple(block_ok.shape)}")
    ok = block_ok.to(torch.uint8)
    group = num_q_heads // num_kv_heads
    out = torch.empty(batch, num_kv_heads, num_blocks, device=query.device, dtype=torch.float32)
    _score_blocks_kernel[(batch * num_kv_heads,)](
        query, summary, ok, out,
        num_blocks, scale,
        query.stride(0), query.stride(1), query.stride(2),
        summary.stride(0), summary.stride(1), summary.stride(2),
        ok.stride(0),
        H_KV=num_kv_heads, GROUP=group, NUM_TOKENS=num_tokens, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=max(16, triton.next_power_of_2(group * num_tokens)),
        BLOCK_N=64, DOT_FP32=INTERPRET or query.dtype == torch.float32,
        IEEE=not INTERPRET and query.dtype == torch.float32,
    )  # fmt: skip
    return out
