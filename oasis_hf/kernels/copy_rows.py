"""Row gather/scatter between any two buffers, including pinned host memory read or written from the GPU.

One launch moves ``N`` rows (a KV block of ``BS * D`` elements, or one token's ``D`` elements) from arbitrary offsets
of `src` to arbitrary offsets of `dst`. When one side is pinned host memory, the GPU reads or writes it directly
through unified virtual addressing (zero-copy): no staging buffer, no loop of ``cudaMemcpy`` calls. On the H200 a
single ``copy_`` per 64 KiB block reaches 4-8 GB/s and 0.4 GB/s for 4 KiB blocks, while a kernel reading pinned
memory directly holds about 50 GB/s from 4 KiB rows up (``shared/docs/design.md``).

Pinned host tensors are accepted by Triton because ``cuPointerGetAttribute`` maps their host pointer to a device
pointer; pageable host memory is rejected by the launcher ("cannot be accessed from Triton").
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


#: Elements one program moves per loop iteration (rows x columns): 8192 bf16 = 16 KiB in flight per program.
_TILE_ELEMS = 8192


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(
        SRC,
        SRC_OFFSETS,
        DST,
        DST_OFFSETS,
        NUM_ROWS,
        ROW_ELEMS,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Persistent: program p moves rows p*ROWS, (p + P)*ROWS, ... (P programs), columns `chunk` of each. A capped
        # P leaves the other SMs to kernels running concurrently on other streams: a program waiting on PCIe holds
        # its SM slot, so an uncapped grid over host memory stalls the decode step it should hide behind.
        pid = tl.program_id(0)
        chunk = tl.program_id(1)
        step = tl.num_programs(0) * ROWS
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        col_ok = cols < ROW_ELEMS
        for base in tl.range(pid * ROWS, NUM_ROWS, step):
            rows = base + tl.arange(0, ROWS)
            src_off = tl.load(SRC_OFFSETS + rows, mask=rows < NUM_ROWS, other=-1)
            dst_off = tl.load(DST_OFFSETS + rows, mask=rows < NUM_ROWS, other=0)
            ok = (src_off >= 0)[:, None] & col_ok[None, :]
            values = tl.load(SRC + src_off[:, None] + cols[None, :], mask=ok)
            tl.store(DST + dst_off[:, None] + cols[None, :], values, mask=ok)


def copy_rows(
    src: torch.Tensor,
    src_offsets: torch.Tensor,
    dst: torch.Tensor,
    dst_offsets: torch.Tensor,
    row_elems: int,
    max_programs: int | None = None,
) -> None:
    """Copy ``N`` rows of `row_elems` contiguous elements from `src` to `dst` in one launch.

    Parameters
    ----------
    src, dst : tensors of one dtype. On the GPU path each is a CUDA tensor or a *pinned* CPU tensor.
    src_offsets, dst_offsets : (N,) int64, on the launching device
        Element offsets of each row relative to ``src.data_ptr()`` / ``dst.data_ptr()``; a negative source offset
        skips the row.
    row_elems : int
        Elements per row (each row contiguous on both sides).
    max_programs : int | None
        Most programs (thread blocks) along the rows; each loops over its share. ``None``: one program per tile of
        rows (fastest alone). A small cap (e.g. 16) keeps a background copy from host memory off most SMs, so it
        overlaps with the compute stream instead of stalling it (`OasisConfig.fetch_programs`).

    The copy is enqueued on the current CUDA stream; order it against other streams with events.
    """
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src dtype {src.dtype} != dst dtype {dst.dtype}")
    if src_offsets.shape != dst_offsets.shape or src_offsets.dim() != 1:
        raise ValueError(
            f"copy_rows: offsets must be two 1-D tensors of one shape, got {tuple(src_offsets.shape)} "
            f"and {tuple(dst_offsets.shape)}"
        )
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"copy_rows: max_programs={max_programs} must be a positive int or None")
    num_rows = src_offsets.numel()
    if num_rows == 0:
        return
    for name, tensor in (("src", src), ("dst", dst)):
        if tensor.device.type == "cpu" and src_offsets.is_cuda and not tensor.is_pinned():
            raise ValueError(
                f"copy_rows: {name} is pageable host memory, which the GPU cannot address; allocate it with "
                "pin_memory=True (OasisConfig.pin_host_memory)"
            )
    block = min(triton.next_power_of_2(row_elems), _TILE_ELEMS)
    rows = max(2, min(_TILE_ELEMS // block, triton.next_power_of_2(num_rows)))  # >= 2: no size-1 aranges
    programs = triton.cdiv(num_rows, rows)
    if max_programs is not None:
        programs = min(programs, max_programs)
    grid = (programs, triton.cdiv(row_elems, block))
    _copy_rows_kernel[grid](src, src_offsets, dst, dst_offsets, num_rows, row_elems, ROWS=rows, BLOCK=block,
                            num_warps=8 if rows * block >= 4096 else 4)
