"""Block scoring with the shared selection rules in two launches: every block's share of the queries' attention,
estimated from its summary keys, then the rules (sinks and recent blocks forced, padding and the future excluded)
and the selection memory.

For each (sequence, KV head) the ``G * T`` query rows of the GQA group form one ``(BLOCK_M, D)`` tile. A row's
score for a block is its softmax over the choosable blocks of the block logits: the mean key's logit, or Quest's
upper bound ``relu(q) . hi + min(q, 0) . lo`` (one bound, two dot products), or the average of both softmax shares
(``mean+minmax``). The rows are summed, so the group shares one selection. A ``quantized`` summary scores tokens:
a row's softmax runs over every real token of the choosable blocks, its logit against the key dequantized from
its codes and its block's bounds, and a block's share is the sum of its tokens'; a tile then holds ``STEP`` blocks
of ``BS`` tokens, worked by planes: the dims whose codes share a bit position of their byte (``4j + p``) form one
(rows x D/4) query tile, so each code byte and each block's bounds load once and four dots add up the logits.

The blocks of one (sequence, KV head) are split over several programs, so that a batch-1 decode at 128k tokens
(4,097 blocks, 8 KV heads) still spreads over the GPU: the first launch (``_stats``) computes each split's running
max and sum of every row's softmax, the second (``_scores``) merges them into the normaliser, recomputes its
split's logits and writes the final scores with the rules and the memory applied. Token scoring does not compute
its logits twice: ``_stats`` also keeps every block's maximum and sum per row, and ``_scores`` rescales those. The
sources without summaries (``recency``, ``raw``) need only the second launch.

A ``quantized`` summary with ``candidates > 0`` scores in two stages, so that only a few blocks' codes are read:
``mean+minmax`` over the bounds and mean keys of every block (both launches, no memory) rates the blocks, a
``topk`` picks the best ``candidates`` (the forced ones first), ``_stats`` marks those candidates and walks their
tokens (their ids split over programs; their mean-key logits in one dot per 16), and the final ``_scores`` launch
normalises each row over the candidates' tokens plus, for every other block, ``BS`` tokens at its mean key's logit
(the first stage's mean channel less the candidates' part of it), so each block's score is its share of one
softmax: four launches, a ``topk`` and the zeroing of the marks.

Twin: `score_blocks_ref` (``oasis_hf.kernels.ref``), which states the rules.
"""

from __future__ import annotations

import math

import torch

from oasis_hf.kernels._tiles import load_query_tile
from oasis_hf.kernels.backend import INTERPRET, sm_count
from oasis_hf.kernels.ref import CODE_BITS, CODES_PER_BYTE, SUMMARY_LAYOUT, check_candidates

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

SOURCES = ("summaries", "recency", "raw")
#: Blocks per tile of the walk over the summaries.
_BLOCK_N = 64
#: Programs per SM of the token path (``quantized``): a tile of its walk is a chain of dependent loads, dequantizing
#: and dots that one program cannot overlap, so it needs more programs than the block path's two.
TOKEN_PROGRAMS_PER_SM = 8
#: Tokens per tile of the token path's walk (``STEP = TOKEN_TILE // BS`` blocks, at least 2).
TOKEN_TILE = 128
#: Candidates per dot of the two-stage walk's mean-key pass (16: the smallest ``tl.dot`` width).
_CAND_TILE = 16
#: Register cap of the two-stage candidates' walk: at 128 (from 178) more of its programs stay resident, and on an
#: H100 SXM the walk over 243 candidates took 62 against 77 us at batch 8 / 32k (12 against 16 at batch 1 / 128k).
#: The one-stage walk gains nothing from a cap (and loses 10% at 168), so it keeps the compiler's choice.
_CAND_MAXNREG = 128


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # float32 operands on the GPU: no silent tf32
            return tl.dot(a, tl.trans(b), input_precision="ieee")
        return tl.dot(a, tl.trans(b))

    @triton.jit
    def _logits(q, q_pos, q_neg, S, base, cols, col_in, dims, dim_ok, stride_sn, scale,
                BOUND: tl.constexpr, MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr,
                HEAD_DIM: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """(BLOCK_M, BLOCK_N) logits of the blocks `cols`: the mean key's, or (`BOUND`) Quest's upper bound."""
        offs = base + cols[:, None] * HEAD_DIM + dims[None, :]
        mask = col_in[:, None] & dim_ok[None, :]
        if BOUND:
            hi = tl.load(S + HI_AT * stride_sn + offs, mask=mask, other=0.0)
            lo = tl.load(S + LO_AT * stride_sn + offs, mask=mask, other=0.0)
            if DOT_FP32:
                hi = hi.to(tl.float32)
                lo = lo.to(tl.float32)
            out = _dot(q_pos, hi, IEEE) + _dot(q_neg, lo, IEEE)
        else:
            s = tl.load(S + MEAN_AT * stride_sn + offs, mask=mask, other=0.0)
            if DOT_FP32:
                s = s.to(tl.float32)
            out = _dot(q, s, IEEE)
        return out * scale

    @triton.jit
    def _query_plane(Q, b, h, stride_qb, stride_qh, stride_qt, PLANE: tl.constexpr, GROUP: tl.constexpr,
                     NUM_ROWS_T: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr,
                     PER_BYTE: tl.constexpr, DOT_FP32: tl.constexpr):  # fmt: skip
        """The query tile's dims ``j * PER_BYTE + PLANE`` as a (BLOCK_M, BLOCK_J) tile: the dims whose codes sit at
        bit ``BITS * PLANE`` of byte `j` (rows as in `load_query_tile`, zero past the real ones)."""
        rows = tl.arange(0, BLOCK_M)
        g = rows // NUM_ROWS_T
        t = rows % NUM_ROWS_T
        dims = tl.arange(0, BLOCK_J) * PER_BYTE + PLANE
        mask = (rows < GROUP * NUM_ROWS_T)[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(Q + b * stride_qb + (h * GROUP + g)[:, None] * stride_qh + t[:, None] * stride_qt + dims[None, :],
                    mask=mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        return q

    @triton.jit
    def _query_planes(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP: tl.constexpr, NUM_ROWS_T: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_M: tl.constexpr, PER_BYTE: tl.constexpr,
                      DOT_FP32: tl.constexpr):  # fmt: skip
        """The four `_query_plane` tiles of the codes' bit positions, loaded once per program."""
        tl.static_assert(PER_BYTE == 4, "the token path unpacks four codes per byte")
        return (_query_plane(Q, b, h, stride_qb, stride_qh, stride_qt, 0, GROUP, NUM_ROWS_T, HEAD_DIM, BLOCK_J,
                             BLOCK_M, PER_BYTE, DOT_FP32),
                _query_plane(Q, b, h, stride_qb, stride_qh, stride_qt, 1, GROUP, NUM_ROWS_T, HEAD_DIM, BLOCK_J,
                             BLOCK_M, PER_BYTE, DOT_FP32),
                _query_plane(Q, b, h, stride_qb, stride_qh, stride_qt, 2, GROUP, NUM_ROWS_T, HEAD_DIM, BLOCK_J,
                             BLOCK_M, PER_BYTE, DOT_FP32),
                _query_plane(Q, b, h, stride_qb, stride_qh, stride_qt, 3, GROUP, NUM_ROWS_T, HEAD_DIM, BLOCK_J,
                             BLOCK_M, PER_BYTE, DOT_FP32))

    @triton.jit
    def _plane_logits(q, byte, S, boffs, bmask, stride_sn, PLANE: tl.constexpr, LO_AT: tl.constexpr,
                      HI_AT: tl.constexpr, BLOCK_SIZE: tl.constexpr, STEP: tl.constexpr, BLOCK_J: tl.constexpr,
                      BITS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """(BLOCK_M, STEP * BS) dot products of one plane of the query with the same plane of the tokens' keys,
        dequantized from `byte` (STEP * BS, BLOCK_J) with their block's bounds (loaded once per block)."""
        lo = tl.load(S + LO_AT * stride_sn + boffs + PLANE, mask=bmask, other=0.0).to(tl.float32)  # (STEP, J)
        hi = tl.load(S + HI_AT * stride_sn + boffs + PLANE, mask=bmask, other=0.0).to(tl.float32)
        code = ((byte >> (BITS * PLANE)) & ((1 << BITS) - 1)).to(tl.float32)
        k = tl.reshape(code, (STEP, BLOCK_SIZE, BLOCK_J)) * ((hi - lo) / ((1 << BITS) - 1))[:, None, :] \
            + lo[:, None, :]
        k = tl.reshape(k, (STEP * BLOCK_SIZE, BLOCK_J))
        return _dot(q, k if DOT_FP32 else k.to(q.dtype), IEEE)

    @triton.jit
    def _token_logits(q0, q1, q2, q3, row_ok, S, CODES, base, code_base, blk, blk_ok, bcols, bcols_ok, kv0,
                      view_end, stride_sn, scale, LO_AT: tl.constexpr, HI_AT: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_J: tl.constexpr, BLOCK_SIZE: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr,
                      PER_BYTE: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """(BLOCK_M, STEP * BS) logits of the tokens of the STEP blocks `bcols` against their dequantized keys
        (``-inf`` where not allowed), and the allowed mask: real tokens of the view in the choosable blocks
        (`bcols_ok`). `blk` and `blk_ok` (STEP * BS) give each token's block and whether it is choosable.

        Per plane (the dims whose codes share a bit position, `q0` .. `q3` from `_query_plane`): each token's code
        bytes load once, (STEP * BS, D / PER_BYTE), and each block's bounds once, broadcast over its tokens."""
        tl.static_assert(PER_BYTE == 4, "the token path unpacks four codes per byte")
        tok = tl.arange(0, STEP * BLOCK_SIZE)
        pos = blk * BLOCK_SIZE + tok % BLOCK_SIZE
        tok_ok = blk_ok & (pos >= kv0) & (pos < view_end)
        j = tl.arange(0, BLOCK_J)
        j_ok = j < HEAD_DIM // PER_BYTE
        byte = tl.load(CODES + code_base + pos[:, None] * (HEAD_DIM // PER_BYTE) + j[None, :],
                       mask=tok_ok[:, None] & j_ok[None, :], other=0).to(tl.int32)
        bmask = bcols_ok[:, None] & j_ok[None, :]
        boffs = base + bcols[:, None] * HEAD_DIM + j[None, :] * PER_BYTE
        x = _plane_logits(q0, byte, S, boffs, bmask, stride_sn, 0, LO_AT, HI_AT, BLOCK_SIZE, STEP, BLOCK_J, BITS,
                          DOT_FP32, IEEE)
        x += _plane_logits(q1, byte, S, boffs, bmask, stride_sn, 1, LO_AT, HI_AT, BLOCK_SIZE, STEP, BLOCK_J, BITS,
                           DOT_FP32, IEEE)
        x += _plane_logits(q2, byte, S, boffs, bmask, stride_sn, 2, LO_AT, HI_AT, BLOCK_SIZE, STEP, BLOCK_J, BITS,
                           DOT_FP32, IEEE)
        x += _plane_logits(q3, byte, S, boffs, bmask, stride_sn, 3, LO_AT, HI_AT, BLOCK_SIZE, STEP, BLOCK_J, BITS,
                           DOT_FP32, IEEE)
        allowed = row_ok[:, None] & tok_ok[None, :]
        return tl.where(allowed, x * scale, float("-inf")), allowed

    @triton.jit
    def _block_stats(x, row_ok, bcols, bcols_ok, BLK_M, BLK_S, bh, num_cap, m0, l0, BLOCK_M: tl.constexpr,
                     STEP: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """Keep each block's (max, sum of exp relative to it) per row of the token logits `x` (BLOCK_M, STEP * BS)
        for `_scores` (which then reads these instead of the codes), and fold them into the running softmax
        statistics (m0, l0)."""
        x3 = tl.reshape(x, (BLOCK_M, STEP, BLOCK_SIZE))
        bmax = tl.max(x3, axis=2)  # (BLOCK_M, STEP); -inf where no token of the block is allowed
        bsafe = tl.where(bmax == float("-inf"), 0.0, bmax)
        bsum = tl.sum(tl.exp(x3 - bsafe[:, :, None]), axis=2)
        rows = tl.arange(0, BLOCK_M)
        boffs = (bh.to(tl.int64) * num_cap + bcols)[None, :] * BLOCK_M + rows[:, None]
        bmask = row_ok[:, None] & bcols_ok[None, :]  # `_scores` reads the real rows only
        tl.store(BLK_M + boffs, bmax, mask=bmask)
        tl.store(BLK_S + boffs, bsum, mask=bmask)
        return _fold(m0, l0, bmax, bsum)

    @triton.jit
    def _fold(m0, l0, x, weight):
        """Running (max, sum) of a row softmax after adding the entries ``weight * exp(x)`` (BLOCK_M, n)."""
        m_new = tl.maximum(m0, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return m_new, l0 * tl.exp(m0 - m_safe) + tl.sum(weight * tl.exp(x - m_safe[:, None]), axis=1)

    @triton.jit
    def _view(START, KV_START, b, START_OFFSET: tl.constexpr, NUM_TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """(first position of the view, blocks in the view, first real block) of sequence `b`."""
        view_start = tl.load(START).to(tl.int64) + START_OFFSET
        num_blocks = (view_start + NUM_TOKENS + BLOCK_SIZE - 1) // BLOCK_SIZE
        first = tl.load(KV_START + b).to(tl.int64) // BLOCK_SIZE
        return view_start, num_blocks, first

    @triton.jit
    def _query_tiles(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP: tl.constexpr, NUM_ROWS_T: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr):
        q, t, row_ok, dims, dim_ok = load_query_tile(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP, NUM_ROWS_T,
                                                     HEAD_DIM, BLOCK_D, BLOCK_M, DOT_FP32)
        return q, tl.maximum(q, 0.0).to(q.dtype), tl.minimum(q, 0.0).to(q.dtype), row_ok, dims, dim_ok

    @triton.jit(do_not_specialize=["num_cap", "per_split", "num_cand"])
    def _stats_kernel(
        Q, S, KV_START, START, M_PART, L_PART, CODES, BLK_M, BLK_S, CAND, MARK,
        num_cap, per_split, num_cand, scale,
        stride_qb, stride_qh, stride_qt, stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_ROWS_T: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        CHANNELS: tl.constexpr, FIRST_BOUND: tl.constexpr, MEAN_AT: tl.constexpr, LO_AT: tl.constexpr,
        HI_AT: tl.constexpr, START_OFFSET: tl.constexpr, NUM_TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        DOT_FP32: tl.constexpr, IEEE: tl.constexpr, TOKENS: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr,
        PER_BYTE: tl.constexpr, BLOCK_J: tl.constexpr, CANDIDATES: tl.constexpr, CAND_TILE: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        h = bh % H_KV
        q, q_pos, q_neg, row_ok, dims, dim_ok = _query_tiles(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP,
                                                             NUM_ROWS_T, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_FP32)
        view_start, num_blocks, first = _view(START, KV_START, b, START_OFFSET, NUM_TOKENS, BLOCK_SIZE)
        kv0 = tl.load(KV_START + b).to(tl.int64)
        if TOKENS:  # the query split into the four planes of the codes, once per program
            q0, q1, q2, q3 = _query_planes(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP, NUM_ROWS_T,
                                           HEAD_DIM, BLOCK_J, BLOCK_M, PER_BYTE, DOT_FP32)
        base = b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
        code_base = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
        m0 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l0 = tl.zeros([BLOCK_M], tl.float32)
        m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l1 = tl.zeros([BLOCK_M], tl.float32)
        if CANDIDATES:
            # The second stage: the tokens of this split's share of the candidate blocks (CAND, ids per (b, h)),
            # channel 0; channel 1 sums the same blocks' mean-key estimates (`_scores` takes them out of the first
            # stage's sum over every block), in one dot per CAND_TILE candidates before the token walk.
            lo_c = split * per_split
            hi_c = tl.minimum(lo_c + per_split, num_cand)
            cand = CAND + bh.to(tl.int64) * num_cand
            for c0 in range(lo_c, hi_c, CAND_TILE):  # mean-key logits and marks, CAND_TILE candidates per dot
                cidx = c0 + tl.arange(0, CAND_TILE)
                ccols = tl.load(cand + cidx, mask=cidx < hi_c, other=0)
                ccols_ok = (cidx < hi_c) & (ccols >= first) & (ccols < num_blocks)
                live = row_ok[:, None] & ccols_ok[None, :]
                xm = tl.where(live, _logits(q, q_pos, q_neg, S, base, ccols, ccols_ok, dims, dim_ok, stride_sn, scale,
                                            False, MEAN_AT, LO_AT, HI_AT, HEAD_DIM, DOT_FP32, IEEE), float("-inf"))
                m1, l1 = _fold(m1, l1, xm, live.to(tl.float32))
                tl.store(MARK + bh.to(tl.int64) * num_cap + ccols, 1, mask=ccols_ok)
            tok = tl.arange(0, STEP * BLOCK_SIZE)
            for i0 in range(lo_c, hi_c, STEP):
                idx = i0 + tl.arange(0, STEP)
                bcols = tl.load(cand + idx, mask=idx < hi_c, other=0)
                bcols_ok = (idx < hi_c) & (bcols >= first) & (bcols < num_blocks)
                tidx = i0 + tok // BLOCK_SIZE
                blk = tl.load(cand + tidx, mask=tidx < hi_c, other=0)
                blk_ok = (tidx < hi_c) & (blk >= first) & (blk < num_blocks)
                x, allowed = _token_logits(q0, q1, q2, q3, row_ok, S, CODES, base, code_base, blk, blk_ok, bcols,
                                           bcols_ok, kv0, view_start + NUM_TOKENS, stride_sn, scale, LO_AT, HI_AT,
                                           HEAD_DIM, BLOCK_J, BLOCK_SIZE, STEP, BITS, PER_BYTE, DOT_FP32, IEEE)
                m0, l0 = _block_stats(x, row_ok, bcols, bcols_ok, BLK_M, BLK_S, bh, num_cap, m0, l0, BLOCK_M, STEP,
                                      BLOCK_SIZE)
        else:
            lo_blk = split * per_split
            hi_blk = tl.minimum(lo_blk + per_split, tl.minimum(num_cap, num_blocks))
            for n0 in range(lo_blk, hi_blk, STEP):
                if TOKENS:
                    blk = n0 + tl.arange(0, STEP * BLOCK_SIZE) // BLOCK_SIZE
                    bcols = n0 + tl.arange(0, STEP)
                    bcols_ok = (bcols < hi_blk) & (bcols >= first)
                    x, allowed = _token_logits(q0, q1, q2, q3, row_ok, S, CODES, base, code_base, blk,
                                               (blk < hi_blk) & (blk >= first), bcols, bcols_ok, kv0,
                                               view_start + NUM_TOKENS, stride_sn, scale, LO_AT, HI_AT, HEAD_DIM,
                                               BLOCK_J, BLOCK_SIZE, STEP, BITS, PER_BYTE, DOT_FP32, IEEE)
                    m0, l0 = _block_stats(x, row_ok, bcols, bcols_ok, BLK_M, BLK_S, bh, num_cap, m0, l0, BLOCK_M,
                                          STEP, BLOCK_SIZE)
                else:
                    cols = n0 + tl.arange(0, BLOCK_N)
                    ok = (cols < hi_blk) & (cols >= first)
                    allowed = row_ok[:, None] & ok[None, :]
                    x = tl.where(allowed, _logits(q, q_pos, q_neg, S, base, cols, ok, dims, dim_ok, stride_sn, scale,
                                                  FIRST_BOUND, MEAN_AT, LO_AT, HI_AT, HEAD_DIM, DOT_FP32, IEEE),
                                 float("-inf"))
                    m0, l0 = _fold(m0, l0, x, allowed.to(tl.float32))
                    if CHANNELS == 2:
                        x = tl.where(allowed, _logits(q, q_pos, q_neg, S, base, cols, ok, dims, dim_ok, stride_sn,
                                                      scale, True, MEAN_AT, LO_AT, HI_AT, HEAD_DIM, DOT_FP32, IEEE),
                                     float("-inf"))
                        m1, l1 = _fold(m1, l1, x, allowed.to(tl.float32))
        rows = tl.arange(0, BLOCK_M)
        part = (bh * NUM_SPLITS + split) * 2 * BLOCK_M
        tl.store(M_PART + part + rows, m0)
        tl.store(L_PART + part + rows, l0)
        tl.store(M_PART + part + BLOCK_M + rows, m1)
        tl.store(L_PART + part + BLOCK_M + rows, l1)

    @triton.jit
    def _merge(M_PART, L_PART, bh, CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
               SPLITS_P2: tl.constexpr):
        """(max, sum relative to it) of every row's softmax over all splits of channel `CHANNEL` (0 and 0 for
        empty rows). Every split's partials load at once as one (SPLITS_P2, BLOCK_M) tile (a loop over 33 splits at
        batch 1 waited on each load in turn)."""
        rows = tl.arange(0, BLOCK_M)
        splits = tl.arange(0, SPLITS_P2)
        split_ok = (splits < NUM_SPLITS)[:, None]
        offs = ((bh * NUM_SPLITS + splits)[:, None] * 2 + CHANNEL) * BLOCK_M + rows[None, :]
        m_all = tl.load(M_PART + offs, mask=split_ok, other=float("-inf"))
        m = tl.max(m_all, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.load(L_PART + offs, mask=split_ok, other=0.0) * tl.exp(m_all - m_safe[None, :]), axis=0)
        return m_safe, total

    @triton.jit
    def _inverse(total):
        return tl.where(total > 0, 1.0 / tl.maximum(total, 1e-30), 0.0)

    @triton.jit
    def _normaliser(M_PART, L_PART, bh, CHANNEL: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr):
        """(max, 1 / sum) of every row's softmax over all splits of channel `CHANNEL` (0 and 0 for empty rows)."""
        m, total = _merge(M_PART, L_PART, bh, CHANNEL, BLOCK_M, NUM_SPLITS, SPLITS_P2)
        return m, _inverse(total)

    @triton.jit
    def _two_stage_normaliser(M_PART, L_PART, M_CAND, L_CAND, bh, log_bs, BLOCK_M: tl.constexpr,
                              NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, CAND_SPLITS: tl.constexpr,
                              CAND_P2: tl.constexpr):
        """(max, 1 / sum) of every row's two-stage softmax: the candidates' tokens (channel 0 of the second stage)
        plus every other block as BS tokens at its mean key's logit: ``BS * (sum over every block - sum over the
        candidates)`` of ``exp(mean logit)`` (channel 0 of the first stage, channel 1 of the second; clamped at 0,
        as rounding may leave the difference a little below it when the candidates hold it all)."""
        m_tok, l_tok = _merge(M_CAND, L_CAND, bh, 0, BLOCK_M, CAND_SPLITS, CAND_P2)
        m_all, l_all = _merge(M_PART, L_PART, bh, 0, BLOCK_M, NUM_SPLITS, SPLITS_P2)
        m_cand, l_cand = _merge(M_CAND, L_CAND, bh, 1, BLOCK_M, CAND_SPLITS, CAND_P2)
        m = tl.maximum(tl.where(l_tok > 0, m_tok, float("-inf")), tl.where(l_all > 0, m_all + log_bs, float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)
        others = l_all * tl.exp(m_all + log_bs - m) - l_cand * tl.exp(m_cand + log_bs - m)
        return m, _inverse(l_tok * tl.exp(m_tok - m) + tl.maximum(others, 0.0))

    @triton.jit(do_not_specialize=["num_cap", "per_split", "sink_blocks", "recent_blocks"])
    def _scores_kernel(
        Q, S, RAW, MEM, OUT, KV_START, START, M_PART, L_PART, BLK_M, BLK_S, M_CAND, L_CAND, MARK,
        num_cap, per_split, scale, decay, sink_blocks, recent_blocks, log_bs,
        stride_qb, stride_qh, stride_qt, stride_sn, stride_sb, stride_sh,
        H_KV: tl.constexpr, GROUP: tl.constexpr, NUM_ROWS_T: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr, SOURCE: tl.constexpr, CHANNELS: tl.constexpr, FIRST_BOUND: tl.constexpr,
        MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr, START_OFFSET: tl.constexpr,
        NUM_TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr, MEMORY: tl.constexpr, MEMORY_WRITE: tl.constexpr,
        DOT_FP32: tl.constexpr, IEEE: tl.constexpr, TOKENS: tl.constexpr, CANDIDATES: tl.constexpr,
        CAND_SPLITS: tl.constexpr, CAND_P2: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        h = bh % H_KV
        view_start, num_blocks, first = _view(START, KV_START, b, START_OFFSET, NUM_TOKENS, BLOCK_SIZE)
        recent_from = tl.minimum(num_blocks - recent_blocks, view_start // BLOCK_SIZE)
        row = bh.to(tl.int64) * num_cap
        lo_blk = split * per_split
        hi_blk = tl.minimum(lo_blk + per_split, num_cap)
        if SOURCE == 0:
            q, q_pos, q_neg, row_ok, dims, dim_ok = _query_tiles(Q, b, h, stride_qb, stride_qh, stride_qt, GROUP,
                                                                 NUM_ROWS_T, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_FP32)
            base = b.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
            if CANDIDATES:
                m0, inv0 = _two_stage_normaliser(M_PART, L_PART, M_CAND, L_CAND, bh, log_bs, BLOCK_M, NUM_SPLITS,
                                                 SPLITS_P2, CAND_SPLITS, CAND_P2)
            else:
                m0, inv0 = _normaliser(M_PART, L_PART, bh, 0, BLOCK_M, NUM_SPLITS, SPLITS_P2)
            if CHANNELS == 2:
                m1, inv1 = _normaliser(M_PART, L_PART, bh, 1, BLOCK_M, NUM_SPLITS, SPLITS_P2)
        for n0 in range(lo_blk, hi_blk, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            in_cap = cols < hi_blk
            ok = in_cap & (cols >= first) & (cols < num_blocks)
            if SOURCE == 0 and TOKENS:  # from the blocks' statistics `_stats` kept: no code is read twice
                rows = tl.arange(0, BLOCK_M)
                live = row_ok[:, None] & ok[None, :]
                if CANDIDATES:  # the candidates' from their tokens, the others' from their mean keys
                    marked = tl.load(MARK + row + cols, mask=ok, other=0) != 0
                    coded = live & marked[None, :]
                else:
                    coded = live
                boffs = (bh.to(tl.int64) * num_cap + cols)[None, :] * BLOCK_M + rows[:, None]
                bmax = tl.load(BLK_M + boffs, mask=coded, other=float("-inf"))
                bsum = tl.load(BLK_S + boffs, mask=coded, other=0.0)
                share = tl.exp(bmax - m0[:, None]) * bsum
                if CANDIDATES:
                    x = _logits(q, q_pos, q_neg, S, base, cols, ok, dims, dim_ok, stride_sn, scale, False, MEAN_AT,
                                LO_AT, HI_AT, HEAD_DIM, DOT_FP32, IEEE)
                    share = tl.where(coded, share, tl.exp(x + log_bs - m0[:, None]))
                score = tl.sum(tl.where(live, share * inv0[:, None], 0.0), axis=0)
            elif SOURCE == 0:
                allowed = row_ok[:, None] & ok[None, :]
                x = _logits(q, q_pos, q_neg, S, base, cols, ok, dims, dim_ok, stride_sn, scale, FIRST_BOUND, MEAN_AT,
                            LO_AT, HI_AT, HEAD_DIM, DOT_FP32, IEEE)
                score = tl.sum(tl.where(allowed, tl.exp(x - m0[:, None]) * inv0[:, None], 0.0), axis=0)
                if CHANNELS == 2:
                    x = _logits(q, q_pos, q_neg, S, base, cols, ok, dims, dim_ok, stride_sn, scale, True, MEAN_AT,
                                LO_AT, HI_AT, HEAD_DIM, DOT_FP32, IEEE)
                    bound = tl.sum(tl.where(allowed, tl.exp(x - m1[:, None]) * inv1[:, None], 0.0), axis=0)
                    score = 0.5 * (score + bound)
            elif SOURCE == 1:
                score = cols.to(tl.float32)
            else:
                score = tl.load(RAW + row + cols, mask=in_cap, other=0.0).to(tl.float32)
            if MEMORY:
                kept = tl.load(MEM + row + cols, mask=in_cap, other=0.0)
                score = tl.maximum(tl.where(ok, score / (GROUP * NUM_ROWS_T), 0.0), kept * decay)
                if MEMORY_WRITE:
                    tl.store(MEM + row + cols, score, mask=in_cap)
            forced = ok & ((cols < first + sink_blocks) | (cols >= recent_from))
            out = tl.where(forced, float("inf"), tl.where(ok, score, float("-inf")))
            tl.store(OUT + row + cols, out, mask=in_cap)


def _splits(batch_heads: int, count: int, device: torch.device, per_sm: int = 2,
            granularity: int = _BLOCK_N) -> tuple[int, int]:
    """(splits, blocks per split) of `count` blocks in tiles of `granularity`: about `per_sm` programs per SM on the
    GPU."""
    tiles = max(1, math.ceil(count / granularity))
    target = min(3, tiles) if device.type != "cuda" else math.ceil(per_sm * sm_count(device) / batch_heads)
    splits = max(1, min(tiles, target))
    per_split = math.ceil(tiles / splits) * granularity
    return max(1, math.ceil(count / per_split)), per_split


def score_blocks(
    query: torch.Tensor,
    summaries: torch.Tensor,
    raw: torch.Tensor | None,
    memory: torch.Tensor | None,
    kv_start: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    *,
    kind: str,
    source: str,
    num_tokens: int,
    block_size: int,
    sink_blocks: int,
    recent_blocks: int,
    decay: float = 0.0,
    start_offset: int = 0,
    memory_write: bool = True,
    codes: torch.Tensor | None = None,
    candidates: int = 0,
) -> torch.Tensor:
    """Every block's selection score, rules and memory applied (Triton; the twin `score_blocks_ref` says what).

    Parameters
    ----------
    query : (B, H_q, T, D) the scoring rows, last dim contiguous (only its shape for the other sources).
    summaries : (n, B, H_kv, NB_cap, D) contiguous, in the layout of `kind` (`SUMMARY_LAYOUT`).
    raw : (B, H_kv, NB_cap) contiguous (``source="raw"``) or None. memory : (B, H_kv, NB_cap) float32 contiguous,
        read when ``decay > 0`` and then updated in place unless ``memory_write=False``.
    kv_start : (B,) int64; start : 0-d int64 tensor (read on the device); scale : softmax scale.
    kind, source, num_tokens, block_size, sink_blocks, recent_blocks, decay, start_offset, memory_write : see the
        twin.
    codes : (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8 contiguous, a ``quantized`` summary's key codes
        (required for it with ``source="summaries"``).
    candidates : ``quantized`` only: the two-stage scoring of the twin (``mean+minmax`` over every block, the
        codes of the best `candidates` alone); 0: the codes of every block.

    Returns
    -------
    (B, H_kv, NB_cap) float32. Enqueued on the current stream; no host synchronisation, capturable.
    """
    if source not in SOURCES:
        raise ValueError(f"score_blocks: unknown source {source!r}; choose one of {list(SOURCES)}")
    check_candidates(kind, candidates)
    layout = SUMMARY_LAYOUT[kind]
    count, batch, num_kv_heads, num_cap, head_dim = summaries.shape
    num_q_heads, num_rows_t = query.shape[1], query.shape[2]
    if count != len(layout) or query.shape[0] != batch or num_q_heads % num_kv_heads or query.shape[3] != head_dim:
        raise ValueError(f"score_blocks: query {tuple(query.shape)} does not match {kind!r} summaries "
                         f"{tuple(summaries.shape)}")
    if not summaries.is_contiguous() or query.stride(-1) != 1:
        raise ValueError("score_blocks: summaries must be contiguous and query contiguous in its last dim")
    for name, tensor in (("raw", raw if source == "raw" else None), ("memory", memory if decay > 0 else None)):
        if tensor is not None and (tensor.shape != (batch, num_kv_heads, num_cap) or not tensor.is_contiguous()):
            raise ValueError(f"score_blocks: {name} must be a contiguous (B, H_kv, NB_cap) tensor")
    if (source == "raw" and raw is None) or (decay > 0 and memory is None):
        raise ValueError("score_blocks: source='raw' needs `raw`, decay > 0 needs `memory`")
    tokens = source == "summaries" and kind == "quantized"
    if tokens and (codes is None or not codes.is_contiguous() or codes.dtype != torch.uint8 or codes.shape != (
            batch, num_kv_heads, num_cap, block_size, head_dim // CODES_PER_BYTE)):
        raise ValueError(f"score_blocks: a 'quantized' summary needs contiguous uint8 codes of shape (B, H_kv, "
                         f"NB_cap, BS, D // {CODES_PER_BYTE}), got {None if codes is None else tuple(codes.shape)}")
    dev = summaries.device
    group = num_q_heads // num_kv_heads
    two_stage = tokens and candidates > 0
    per_sm = TOKEN_PROGRAMS_PER_SM if tokens and not two_stage else 2
    splits, per_split = _splits(batch * num_kv_heads, num_cap, dev, per_sm)
    block_m = max(16, triton.next_power_of_2(group * num_rows_t))
    out = torch.empty(batch, num_kv_heads, num_cap, device=dev, dtype=torch.float32)
    m_part = torch.empty(batch * num_kv_heads * splits * 2 * block_m, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    # Token scoring: every block's (max, sum) per query row, from `_stats` to `_scores` (4 * 2 * BLOCK_M bytes per
    # block: 128 at one token and a group of 4, against the 1 KiB of codes per block of 32 it saves reading again).
    blk_m = torch.empty(batch * num_kv_heads * num_cap * block_m, device=dev, dtype=torch.float32) if tokens else m_part
    blk_s = torch.empty_like(blk_m) if tokens else l_part  # (the block path never touches them)
    kv_start = kv_start.to(torch.int64)
    channels = 2 if kind == "mean+minmax" else 1
    step = max(2, TOKEN_TILE // block_size) if tokens else _BLOCK_N
    common = dict(
        H_KV=num_kv_heads, GROUP=group, NUM_ROWS_T=num_rows_t, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=_BLOCK_N, NUM_SPLITS=splits,
        FIRST_BOUND=kind == "minmax", MEAN_AT=layout.index("mean") if "mean" in layout else 0,
        LO_AT=layout.index("lo") if "lo" in layout else 0, HI_AT=layout.index("hi") if "hi" in layout else 0,
        START_OFFSET=start_offset, NUM_TOKENS=num_tokens, BLOCK_SIZE=block_size,
        DOT_FP32=INTERPRET or query.dtype == torch.float32, IEEE=not INTERPRET and query.dtype == torch.float32,
    )  # fmt: skip
    tiles = dict(STEP=step, BITS=CODE_BITS, PER_BYTE=CODES_PER_BYTE, CAND_TILE=_CAND_TILE,
                 BLOCK_J=max(16, triton.next_power_of_2(head_dim // CODES_PER_BYTE)))
    strides = (query.stride(0), query.stride(1), query.stride(2), summaries.stride(0), summaries.stride(1),
               summaries.stride(2))
    code_strides = (codes.stride(0), codes.stride(1)) if tokens else (0, 0)
    grid = (batch * num_kv_heads, splits)
    # The final scores launch's two-stage inputs (the second stage's partials and the candidates' marks; unread
    # placeholders otherwise) and constants.
    cand_inputs, cand_consts = (m_part, l_part, out), dict(CANDIDATES=False, CAND_SPLITS=1, CAND_P2=2)
    if two_stage:
        # First stage: mean+minmax over every block (its partials in m_part / l_part, kept for the normaliser), its
        # scores with the rules (forced blocks +inf), and the best `candidates` of them.
        _stats_kernel[grid](
            query, summaries, kv_start, start, m_part, l_part, summaries, m_part, l_part, kv_start, out, num_cap,
            per_split, 0, scale, *strides, 0, 0, CHANNELS=2, TOKENS=False, CANDIDATES=False,
            **dict(tiles, STEP=_BLOCK_N), **common,
        )  # fmt: skip
        first = torch.empty_like(out)
        _scores_kernel[grid](
            query, summaries, out, out, first, kv_start, start, m_part, l_part, m_part, l_part, m_part, l_part, out,
            num_cap, per_split, scale, 0.0, sink_blocks, recent_blocks, 0.0, *strides,
            SPLITS_P2=max(2, triton.next_power_of_2(splits)), SOURCE=0, CHANNELS=2, MEMORY=False,
            MEMORY_WRITE=False, TOKENS=False, **cand_consts, **common,
        )  # fmt: skip
        num_cand = min(candidates, num_cap)
        picked = first.topk(num_cand, dim=-1, sorted=False).indices.contiguous()  # (B, H_kv, C)
        mark = torch.zeros(batch, num_kv_heads, num_cap, device=dev, dtype=torch.int8)
        # Second stage: the candidates' tokens, split over programs in tiles of `step` blocks.
        cand_splits, cand_per_split = _splits(batch * num_kv_heads, num_cand, dev, TOKEN_PROGRAMS_PER_SM, step)
        m_cand = torch.empty(batch * num_kv_heads * cand_splits * 2 * block_m, device=dev, dtype=torch.float32)
        l_cand = torch.empty_like(m_cand)
        _stats_kernel[(batch * num_kv_heads, cand_splits)](
            query, summaries, kv_start, start, m_cand, l_cand, codes, blk_m, blk_s, picked, mark, num_cap,
            cand_per_split, num_cand, scale, *strides, *code_strides, CHANNELS=1, TOKENS=True, CANDIDATES=True,
            **tiles, **dict(common, NUM_SPLITS=cand_splits), maxnreg=_CAND_MAXNREG,
        )  # fmt: skip
        cand_inputs = (m_cand, l_cand, mark)
        cand_consts = dict(CANDIDATES=True, CAND_SPLITS=cand_splits,
                           CAND_P2=max(2, triton.next_power_of_2(cand_splits)))
    elif source == "summaries":
        _stats_kernel[grid](
            query, summaries, kv_start, start, m_part, l_part, codes if tokens else summaries, blk_m, blk_s, kv_start,
            out, num_cap, per_split, 0, scale, *strides, *code_strides, CHANNELS=1 if tokens else channels,
            TOKENS=tokens, CANDIDATES=False, **tiles, **common,
        )  # fmt: skip
    _scores_kernel[grid](
        query, summaries, raw if raw is not None else out, memory if memory is not None else out, out, kv_start,
        start, m_part, l_part, blk_m, blk_s, *cand_inputs, num_cap, per_split, scale, float(decay), sink_blocks,
        recent_blocks, math.log(block_size), *strides, SPLITS_P2=max(2, triton.next_power_of_2(splits)),
        SOURCE=SOURCES.index(source), MEMORY=decay > 0, MEMORY_WRITE=memory_write, CHANNELS=1 if tokens else channels,
        TOKENS=tokens, **cand_consts, **common,
    )  # fmt: skip
    return out
