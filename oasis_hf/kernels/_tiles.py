"""Triton pieces shared by the decode kernels (`score_blocks`, `sparse_attention`)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs run the PyTorch twins
    triton = None
    load_query_tile = None  # importable without Triton; only the Triton kernels use it


if triton is not None:

    @triton.jit
    def load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP: tl.constexpr, NUM_TOKENS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        DOT_FP32: tl.constexpr):  # fmt: skip
        """The ``GROUP * NUM_TOKENS`` query rows of KV head `h` of sequence `b` as one (BLOCK_M, BLOCK_D) tile.

        Row ``m = g * NUM_TOKENS + t`` is query head ``h * GROUP + g`` at new token `t`; rows and dims past the
        real ones are zero. Returns (tile, t, row_ok, dims, dim_ok); the tile is float32 when `DOT_FP32` (the
        interpreter's `tl.dot` wants float32 operands)."""
        rows = tl.arange(0, BLOCK_M)
        g = rows // NUM_TOKENS
        t = rows % NUM_TOKENS
        row_ok = rows < GROUP * NUM_TOKENS
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_ptrs = Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        return q, t, row_ok, dims, dim_ok
