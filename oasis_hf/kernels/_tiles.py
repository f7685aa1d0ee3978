"""Triton pieces shared by several kernels: a GQA group's query tile (`score_blocks`, `sparse_attention`) and a
block's summaries from its keys (`append_tokens`, `summarize_keys`)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs run the PyTorch twins
    triton = None
    load_query_tile = None  # importable without Triton; only the Triton kernels use them
    store_block_summaries = None


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

    @triton.jit
    def store_block_summaries(kf, ok, SUMMARY, CODES, where, code_base, block, rows, dims, dim_ok, row_mask,
                              stride_sn, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr, QUANT: tl.constexpr,
                              BITS: tl.constexpr, PER_BYTE: tl.constexpr):  # fmt: skip
        """Write one block's summaries (`oasis_hf.kernels.ref.summarize_blocks`) and, for ``quantized``, its key
        codes (`quantize_blocks`, against the bounds as stored).

        kf : (BLOCK_SIZE, BLOCK_D) float32 keys of the block as stored; ok : (BLOCK_SIZE,) real and written tokens;
        `where` the offset of summary 0 of this block in `SUMMARY` (``+ INDEX * stride_sn`` for the others),
        `code_base` that of its (sequence, KV head) in `CODES`; `dim_ok` the dims stored, `row_mask` the code rows
        stored. The summaries are float32 over the real tokens, zero for an empty block; ``*_AT`` their index in the
        layout or -1."""
        if MEAN_AT >= 0:
            count = tl.maximum(tl.sum(ok.to(tl.float32), axis=0), 1.0)
            mean = tl.sum(tl.where(ok[:, None], kf, 0.0), axis=0) / count
            tl.store(SUMMARY + MEAN_AT * stride_sn + where + dims, mean.to(SUMMARY.dtype.element_ty), mask=dim_ok)
        if LO_AT >= 0:
            any_ok = tl.sum(ok.to(tl.int32), axis=0) > 0
            lo = tl.where(any_ok, tl.min(tl.where(ok[:, None], kf, float("inf")), axis=0), 0.0)
            hi = tl.where(any_ok, tl.max(tl.where(ok[:, None], kf, float("-inf")), axis=0), 0.0)
            tl.store(SUMMARY + LO_AT * stride_sn + where + dims, lo.to(SUMMARY.dtype.element_ty), mask=dim_ok)
            tl.store(SUMMARY + HI_AT * stride_sn + where + dims, hi.to(SUMMARY.dtype.element_ty), mask=dim_ok)
            if QUANT:  # every key's codes against the bounds as stored (`quantize_blocks`)
                lo_s = lo.to(SUMMARY.dtype.element_ty).to(tl.float32)
                width = hi.to(SUMMARY.dtype.element_ty).to(tl.float32) - lo_s
                wide = width > 0
                levels = (1 << BITS) - 1
                scaled = tl.div_rn(kf - lo_s[None, :], tl.where(wide, width, 1.0)[None, :]) * levels
                code = tl.minimum(tl.maximum(tl.floor(scaled + 0.5), 0.0), levels * 1.0)
                code = tl.where(ok[:, None] & wide[None, :], code, 0.0).to(tl.int32)
                packed = tl.sum(tl.reshape(code << (BITS * (dims % PER_BYTE))[None, :],
                                           (BLOCK_SIZE, BLOCK_D // PER_BYTE, PER_BYTE)), axis=2)
                cols = tl.arange(0, BLOCK_D // PER_BYTE)
                code_offs = code_base + (block * BLOCK_SIZE + rows[:, None]) * (HEAD_DIM // PER_BYTE) + cols[None, :]
                code_ok = row_mask[:, None] & (cols < HEAD_DIM // PER_BYTE)[None, :]
                tl.store(CODES + code_offs, packed.to(tl.uint8), mask=code_ok)
