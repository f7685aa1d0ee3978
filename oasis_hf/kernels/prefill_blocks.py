"""A prompt's blocks after a prefill forward, one launch each: their summaries, and the pool filled from them.

After the dense attention of a prefill (or of a chunk of one), OasisKV summarises every block the forward touched
and copies the first selection's blocks into the GPU pool. In PyTorch that is a padded copy of the whole K and V
(to whole blocks), the token mask, the summaries' masked reductions and their stack, an index copy into the
summaries, and a gather and scatter per pool: about 30 small kernels per layer, each a few microseconds, and two
passes over the prompt's K/V that nothing else needs. Here the keys are read in place (any strides with a contiguous
last dim), once per block:

- `summarize_keys`: one program per (sequence, KV head, block) writes the block's summaries (mean key, per-channel
  bounds) and, for a ``quantized`` summary, its key codes, exactly as `append_tokens` summarises a decode step's
  blocks (`oasis_hf.kernels._tiles.store_block_summaries`);
- `fill_pool`: one program per (sequence, KV head, slot) copies the K and V rows of the block the residency table
  puts in that slot, zero past the last token; slots that hold no block are left as they are.

Twins: `summarize_keys_ref`, `fill_pool_ref` (``oasis_hf.kernels.ref``).
"""

from __future__ import annotations

import torch

from oasis_hf.kernels._tiles import store_block_summaries
from oasis_hf.kernels.ref import CODE_BITS, CODES_PER_BYTE, SUMMARY_LAYOUT

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit(do_not_specialize=["length", "first_block"])
    def _summarize_kernel(
        K, KV_START, SUMMARY, CODES, length, first_block,
        stride_kb, stride_kh, stride_kt, stride_sn, stride_sb, stride_sh, stride_cb, stride_ch,
        H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        MEAN_AT: tl.constexpr, LO_AT: tl.constexpr, HI_AT: tl.constexpr, QUANT: tl.constexpr,
        BITS: tl.constexpr, PER_BYTE: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        b = (bh // H_KV).to(tl.int64)
        h = (bh % H_KV).to(tl.int64)
        block = first_block + tl.program_id(1).to(tl.int64)
        rows = tl.arange(0, BLOCK_SIZE)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        pos = block * BLOCK_SIZE + rows
        written = pos < length
        k = tl.load(K + b * stride_kb + h * stride_kh + pos[:, None] * stride_kt + dims[None, :],
                    mask=written[:, None] & dim_ok[None, :], other=0.0)
        ok = written & (pos >= tl.load(KV_START + b))
        store_block_summaries(
            k.to(tl.float32), ok, SUMMARY, CODES, b * stride_sb + h * stride_sh + block * HEAD_DIM,
            b * stride_cb + h * stride_ch, block, rows, dims, dim_ok, rows < BLOCK_SIZE, stride_sn,
            HEAD_DIM, BLOCK_D, BLOCK_SIZE, MEAN_AT, LO_AT, HI_AT, QUANT, BITS, PER_BYTE,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["length", "stride_slot_row"])
    def _fill_pool_kernel(
        K, V, SLOT_BLOCK, POOL_K, POOL_V, length,
        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_pb, stride_ph, stride_ps,
        stride_slot_row,
        H_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        b = (bh // H_KV).to(tl.int64)
        h = (bh % H_KV).to(tl.int64)
        slot = tl.program_id(1).to(tl.int64)
        block = tl.load(SLOT_BLOCK + bh.to(tl.int64) * stride_slot_row + slot)
        rows = tl.arange(0, BLOCK_SIZE)
        dims = tl.arange(0, BLOCK_D)
        pos = block * BLOCK_SIZE + rows
        held = (block + rows * 0) >= 0  # (vector comparisons: the interpreter turns `scalar & vector` into ints)
        store = held[:, None] & (dims < HEAD_DIM)[None, :]
        read = store & (pos < length)[:, None]
        k = tl.load(K + b * stride_kb + h * stride_kh + pos[:, None] * stride_kt + dims[None, :], mask=read, other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + pos[:, None] * stride_vt + dims[None, :], mask=read, other=0.0)
        dst = b * stride_pb + h * stride_ph + slot * stride_ps + rows[:, None] * HEAD_DIM + dims[None, :]
        tl.store(POOL_K + dst, k.to(POOL_K.dtype.element_ty), mask=store)
        tl.store(POOL_V + dst, v.to(POOL_V.dtype.element_ty), mask=store)


def summarize_keys(
    keys: torch.Tensor,
    kv_start: torch.Tensor,
    summaries: torch.Tensor,
    *,
    kind: str,
    block_size: int,
    first_block: int = 0,
    codes: torch.Tensor | None = None,
) -> None:
    """Summarise blocks ``first_block .. ceil(L / BS) - 1`` of a sequence's keys, in one launch.

    Parameters
    ----------
    keys : (B, H_kv, L, D) every key at positions ``0 .. L - 1``, last dim contiguous (any other strides).
    kv_start : (B,) int64 first real position (left padding before it is not summarised).
    summaries : (n, B, H_kv, NB_cap, D) in the layout of `kind` (`SUMMARY_LAYOUT`), contiguous, ``NB_cap >=
        ceil(L / BS)``; the blocks' entries are overwritten.
    kind : the summary kind. block_size : ``BS``.
    first_block : the first block to summarise (a chunk's first touched block).
    codes : (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8, contiguous: a ``quantized`` summary's key codes
        (required for it), overwritten for the same blocks.

    A block's summaries cover its real tokens (``kv_start[b] <= position < L``), in float32, stored in the
    summaries' dtype; zero for a block with none. Same as `summarize_keys_ref` up to float32 summation order.
    Enqueued on the current stream; no host synchronisation.
    """
    batch, heads, length, head_dim = keys.shape
    layout = SUMMARY_LAYOUT[kind]
    quant = kind == "quantized"
    num_blocks = -(-length // block_size) - first_block
    _check_summaries(summaries, codes, layout, quant, (batch, heads, head_dim, block_size), first_block + num_blocks)
    if keys.stride(-1) != 1:
        raise ValueError(f"summarize_keys: keys must be contiguous in their last dim (strides {keys.stride()})")
    if num_blocks <= 0:
        return
    _summarize_kernel[(batch * heads, num_blocks)](
        keys, kv_start.to(torch.int64), summaries, codes if quant else summaries, length, first_block,
        keys.stride(0), keys.stride(1), keys.stride(2), summaries.stride(0), summaries.stride(1), summaries.stride(2),
        codes.stride(0) if quant else 0, codes.stride(1) if quant else 0,
        H_KV=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        MEAN_AT=layout.index("mean") if "mean" in layout else -1,
        LO_AT=layout.index("lo") if "lo" in layout else -1,
        HI_AT=layout.index("hi") if "hi" in layout else -1,
        QUANT=quant, BITS=CODE_BITS, PER_BYTE=CODES_PER_BYTE, num_warps=4,
    )  # fmt: skip


def fill_pool(
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_block: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
) -> None:
    """Copy every resident block's K/V rows into its slot, in one launch.

    Parameters
    ----------
    keys, values : (B, H_kv, L, D) every token at positions ``0 .. L - 1``, last dim contiguous.
    slot_block : (B, H_kv, S') int64, contiguous in its last dim, ``S' >= S``: the block each of the first ``S``
        slots holds (``< ceil(L / BS)``), -1 for none (a `BlockTable`'s ``slot_block``; its trash column is ignored).
    pool_k, pool_v : (B, H_kv, S, BS, D), each block contiguous, both alike.

    Slot ``s`` holding block ``j`` gets the rows of positions ``j * BS .. j * BS + BS - 1``, zero past ``L - 1``;
    slots holding no block keep their contents. Same as `fill_pool_ref`. Enqueued on the current stream.
    """
    batch, heads, length, head_dim = keys.shape
    num_slots, block_size = pool_k.shape[2], pool_k.shape[3]
    if values.shape != keys.shape or pool_v.shape != pool_k.shape or pool_k.shape[:2] != (batch, heads) or (
            pool_k.shape[4] != head_dim or slot_block.shape[:2] != (batch, heads) or slot_block.shape[2] < num_slots):
        raise ValueError(f"fill_pool: keys {tuple(keys.shape)}, values {tuple(values.shape)}, pool "
                         f"{tuple(pool_k.shape)} and slot_block {tuple(slot_block.shape)} disagree")
    for name, tensor in (("keys", keys), ("values", values), ("slot_block", slot_block)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"fill_pool: {name} must be contiguous in its last dim (strides {tensor.stride()})")
    for name, tensor in (("pool_k", pool_k), ("pool_v", pool_v)):
        if tensor.stride(3) != head_dim or tensor.stride(4) != 1 or tensor.stride() != pool_k.stride():
            raise ValueError(f"fill_pool: each block of {name} must be contiguous (BS, D), both pools alike")
    if slot_block.stride(0) != heads * slot_block.stride(1):
        raise ValueError(f"fill_pool: slot_block's rows must be evenly spaced (strides {slot_block.stride()})")
    _fill_pool_kernel[(batch * heads, num_slots)](
        keys, values, slot_block, pool_k, pool_v, length,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        pool_k.stride(0), pool_k.stride(1), pool_k.stride(2), slot_block.stride(1),
        H_KV=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        num_warps=4,
    )  # fmt: skip


def _check_summaries(summaries, codes, layout, quant: bool, dims: tuple, blocks_needed: int) -> None:
    """Shapes of `summarize_keys`' outputs for keys of (batch, heads, head_dim) and blocks of `block_size`."""
    batch, heads, head_dim, block_size = dims
    if summaries.shape[:3] != (len(layout), batch, heads) or summaries.shape[4] != head_dim or (
            not summaries.is_contiguous() or summaries.shape[3] < blocks_needed):
        raise ValueError(f"summarize_keys: summaries {tuple(summaries.shape)} are not contiguous summaries in the "
                         f"layout {layout} of {blocks_needed} blocks of these keys")
    if quant and (codes is None or not codes.is_contiguous() or codes.dtype != torch.uint8 or codes.shape != (
            batch, heads, summaries.shape[3], block_size, head_dim // CODES_PER_BYTE)):
        raise ValueError(f"summarize_keys: a 'quantized' summary needs contiguous uint8 codes of shape (B, H_kv, "
                         f"NB_cap, BS, D // {CODES_PER_BYTE}), got {None if codes is None else tuple(codes.shape)}")
