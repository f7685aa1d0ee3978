"""`HostKVStore`: the full K/V of every managed layer in host memory, block-addressed.

Layout per layer and segment: ``(B, H_kv, NB_seg, BS, D)``, so one (sequence, head, block) is one contiguous run of
``BS * D`` elements (one row for the gather kernel). The store grows by appending segments (each at least half the
current capacity): tokens already written are never copied again. Memory is pinned when CUDA is present, so the GPU
reads (fetch, `gather_blocks`) and writes (write-back, `copy_rows`) it directly; long writes (a prefill's) go
through the copy engines instead, which hold no SM while the prefill computes. A segment is one buffer page-locked
at its exact size (`PinnedBuffer`), not PyTorch's power-of-two-rounded pinned allocations, and every GPU of the
process can address it (a model split across GPUs shares one store).

An allocation is checked against the free host memory *before* it is made, for all layers at once, and fails with
`HostMemoryError` naming the bytes needed and available.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import psutil
import torch

from oasis_hf.cache.pinned import PinnedBuffer, PinnedPool
from oasis_hf.config import blocks_for
from oasis_hf.errors import HostMemoryError
from oasis_hf.kernels import copy_rows, gather_blocks, gather_blocks_ref, write_tokens

logger = logging.getLogger(__name__)

#: Write-back offsets are memoised for forwards of at most this many tokens (decode and draft verification), whose
#: shapes repeat every step; a prefill's offsets are built once and dropped.
_MEMO_MAX_TOKENS = 64
#: A write-back whose contiguous run per (sequence, KV head) reaches this many bytes (a prefill: 2,048 tokens of
#: 128 bf16 dims and up) goes through the copy engines (``cudaMemcpyAsync``), which move it without holding any SM;
#: shorter runs take the zero-copy kernel, which needs one launch where the copy engines need one per run.
COPY_ENGINE_MIN_RUN_BYTES = 512 * 2**10


def size_class(blocks: int) -> int:
    """`blocks` rounded up to the next of eight sizes per doubling (at most 12.5% more): a store's first segment is
    sized so, and a `PinnedPool` buffer returned by one request then fits the next request of about the same length
    (another prompt, another ``max_new_tokens``) instead of being page-locked anew during its prefill."""
    step = max(1, (1 << (blocks.bit_length() - 1)) // 8)
    return -(-blocks // step) * step


class BlockStore(Protocol):
    """The host tier of an `OasisCache`: where every block lives, and what the GPU pool is filled from.

    Implementations: `HostKVStore` (the full K/V in local pinned memory) and `oasis_hf.remote.RemoteBlockStore` (the
    full K/V in a Mooncake Store pool; the decode node keeps a tail ring and a hot-block cache). Shapes: keys/values
    (B, H_kv, T, D); blocks/slots/valid (B, H_kv, N); pools (B, H_kv, S, BS, D).
    """

    batch_size: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    pin: bool  # the GPU reads and writes the host buffers directly (zero-copy kernels)
    capacity_blocks: int  # logical blocks addressable
    capturable_fetch: bool  # `fetch` is device work only (a selection job calling it may be a CUDA graph)
    reusable: bool  # keeps no state of its request: `OasisCache.reset` empties the cache and keeps this store

    @property
    def nbytes(self) -> int: ...  # host bytes held
    def bytes_per_block(self) -> int: ...
    def ensure_capacity(self, num_tokens: int, reserve_tokens: int = 0) -> bool: ...
    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None: ...
    def write_at(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> None: ...
    def fetch(self, layer: int, blocks: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
              slots: torch.Tensor, valid: torch.Tensor, backend: str,
              max_programs: int | None = None) -> None: ...  # fmt: skip
    def read_keys(self, layer: int, num_tokens: int) -> torch.Tensor: ...
    def read_range(self, layer: int, num_tokens: int, device, values: bool = True): ...
    def note_step(self, layer: int, end: int) -> None: ...
    def prefetch_hint(self, layer: int, scores: torch.Tensor, num_slots: int) -> None: ...
    def truncate(self, layer: int, length: int) -> None: ...
    def release(self) -> None: ...  # free the memory; the store can grow again
    def close(self) -> None: ...  # the cache is closed: the request is finished


class _LayerViews(dict):
    """layer_idx -> that layer's (B, H_kv, NB_seg, BS, D) tensor over a segment's buffer, at byte
    ``order[layer] * span_bytes + start``, made on first use: a prefill's first layer would otherwise make every
    layer's views (about 16 us of host time each) while the GPU, not yet given any work of the forward, waits."""

    def __init__(self, buffer: PinnedBuffer, order: dict[int, int], span_bytes: int, start: int,
                 shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.buffer, self.order, self.span_bytes, self.start = buffer, order, span_bytes, start
        self.shape, self.dtype = shape, dtype

    def __missing__(self, layer: int) -> torch.Tensor:
        offset = self.order[layer] * self.span_bytes + self.start  # KeyError: a layer the store does not manage
        view = self[layer] = self.buffer.view(offset, self.shape, self.dtype)
        return view


@dataclass
class _Segment:
    start_block: int
    num_blocks: int
    keys: _LayerViews  # layer_idx -> (B, H_kv, NB_seg, BS, D), views of `buffer`
    values: _LayerViews
    buffer: PinnedBuffer
    span_bytes: int  # one layer's K and V: layer i holds bytes i * span_bytes .. (i + 1) * span_bytes - 1
    order: dict[int, int]  # layer_idx -> its position in the buffer

    def ready(self, layer: int) -> None:
        """Wait until `layer`'s range is page-locked (a fresh buffer is locked in the background, in layer order)."""
        self.buffer.ready(self.order[layer] * self.span_bytes, self.span_bytes)


class HostKVStore:
    """Full K/V of the managed layers of one cache, in (pinned) host memory.

    Parameters
    ----------
    layer_ids : managed (full-attention) layer indices.
    batch_size, num_kv_heads, head_dim, block_size : shapes of one layer's store.
    dtype : element type (the model's KV dtype).
    pin : pin the memory (required for GPU zero-copy access).
    headroom_bytes : host memory that must stay free after an allocation.
    growth_tokens : smallest growth step.
    limit_bytes : most bytes the store may hold; when given it replaces the check against the OS's available memory
        (which under-reports on machines whose memory grows on demand, e.g. ballooned VMs).
    """

    capturable_fetch = True  # `fetch` is device work only: a selection job that calls it can be a CUDA graph
    reusable = True  # rows past a layer's length are simply overwritten: a reset cache keeps the memory

    def __init__(
        self,
        layer_ids: list[int],
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        pin: bool,
        headroom_bytes: int,
        growth_tokens: int,
        limit_bytes: int | None = None,
        pool: PinnedPool | None = None,
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.block_size, self.dtype, self.pin = block_size, dtype, pin
        self.headroom_bytes = headroom_bytes
        self.limit_bytes = limit_bytes
        self.growth_blocks = max(1, growth_tokens // block_size)
        self.pool = pool
        self.segments: list[_Segment] = []
        self.capacity_blocks = 0
        self._row_offsets: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bh_cache: dict[tuple, torch.Tensor] = {}

    # ----------------------------------------------------------------------------------------------- allocation
    def bytes_per_block(self) -> int:
        """Host bytes of one block (K and V) of one layer, for the whole batch."""
        elem = self.dtype.itemsize
        return 2 * self.batch_size * self.num_kv_heads * self.block_size * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.capacity_blocks * self.bytes_per_block() * len(self.layer_ids)

    def ensure_capacity(self, num_tokens: int, reserve_tokens: int = 0) -> bool:
        """Make room for `num_tokens` tokens per sequence in every layer, and for `reserve_tokens` (a planned length:
        all of it now, or a `HostMemoryError` saying what fits); returns True if the store grew. The first segment
        prefers the `size_class` of what is required, growth half the current size at once; either takes only what
        is required when that preference does not fit."""
        needed = blocks_for(num_tokens, self.block_size)
        if needed <= self.capacity_blocks:
            return False
        required = max(needed, blocks_for(reserve_tokens, self.block_size)) - self.capacity_blocks
        if self.capacity_blocks:
            preferred = max(required, self.growth_blocks, self.capacity_blocks // 2)
        else:  # the first segment in size classes: requests of similar lengths reuse a pool's buffers
            preferred = size_class(required)
        try:
            self._allocate_segment(preferred)
        except HostMemoryError:
            if preferred == required:
                raise
            self._allocate_segment(required)
        return True

    def _allocate_segment(self, num_blocks: int) -> None:
        per_tensor = num_blocks * self.bytes_per_block() // 2
        nbytes = 2 * per_tensor * len(self.layer_ids)
        held = self.capacity_blocks * self.block_size
        if self.limit_bytes is not None:
            available, headroom = max(0, self.limit_bytes - self.nbytes), 0
        else:
            available, headroom = psutil.virtual_memory().available, self.headroom_bytes
        buffer = self.pool.take(nbytes, self.pin) if self.pool is not None else None
        if buffer is None and self.limit_bytes is None and self.pool is not None and self.pool.free_bytes:
            self.pool.clear()  # nothing fits: the free buffers go back to the OS before the check below
            available = psutil.virtual_memory().available
        block_bytes = self.bytes_per_block() * len(self.layer_ids)  # one more block per sequence, every layer
        fits = (self.capacity_blocks + max(0, available - headroom) // block_bytes) * self.block_size

        def refused() -> HostMemoryError:
            return HostMemoryError(nbytes, available, headroom, held, limited=self.limit_bytes is not None,
                                   fits_tokens=fits)

        if buffer is None or self.limit_bytes is not None:  # a reused buffer is memory held already
            if nbytes + headroom > available:
                if buffer is not None:
                    self.pool.give([buffer])
                raise refused()
        shape = (self.batch_size, self.num_kv_heads, num_blocks, self.block_size, self.head_dim)
        try:
            # One registered range per layer (its K and V), page-locked in layer order on a thread: a prefill's
            # write-back of layer i waits for range i only, so the locking overlaps the GPU work of the layers.
            buffer = buffer if buffer is not None else PinnedBuffer(nbytes, pin=self.pin, chunk_bytes=2 * per_tensor,
                                                                    background=True)
        except (RuntimeError, MemoryError) as exc:  # malloc or cudaHostRegister refused: nothing is kept
            raise refused() from exc
        order = {layer: i for i, layer in enumerate(self.layer_ids)}
        keys = _LayerViews(buffer, order, 2 * per_tensor, 0, shape, self.dtype)
        values = _LayerViews(buffer, order, 2 * per_tensor, per_tensor, shape, self.dtype)
        self.segments.append(_Segment(self.capacity_blocks, num_blocks, keys, values, buffer, 2 * per_tensor, order))
        self.capacity_blocks += num_blocks
        logger.debug("host store: +%d blocks (%.1f MiB, pinned=%s)", num_blocks, nbytes / 2**20, self.pin)

    def note_step(self, layer: int, end: int) -> None:
        """Hook for stores that track sequence progress from the host (`RemoteBlockStore`); nothing to do here."""

    def prefetch_hint(self, layer: int, scores: torch.Tensor, num_slots: int) -> None:
        """Hook for stores behind a slower link (`RemoteBlockStore` pulls likely blocks ahead); every block is one
        PCIe gather away here."""

    def truncate(self, layer: int, length: int) -> None:
        """Hook for stores that cache completed blocks (`RemoteBlockStore`); rows past `length` are simply
        overwritten here."""

    def close(self) -> None:
        """The cache is done with its sequences: with a pool its buffers go back to the pool now (the cache refuses
        further use); without one nothing is handed back (the memory goes with the cache). A remote store frees the
        request's objects."""
        if self.pool is not None:
            self.release()

    def release(self) -> None:
        """Free all host memory, or return it to the pool (the store can grow again afterwards)."""
        buffers = [seg.buffer for seg in self.segments]
        self.segments.clear()
        self.capacity_blocks = 0
        if self.pool is None:
            for buffer in buffers:
                buffer.release()
            return
        if buffers and torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):  # zero-copy kernels may still read or write them
                torch.cuda.synchronize(index)
        self.pool.give(buffers)

    # ---------------------------------------------------------------------------------------------------- write
    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store new tokens at positions ``start .. start + T - 1`` of every sequence.

        `keys`/`values`: (B, H_kv, T, D), on any device, last dim contiguous. A CUDA source is written on the
        *current* stream (the caller picks the write-back stream and keeps the source alive, e.g. with
        ``record_stream``): with the zero-copy kernel, or through the copy engines when each (sequence, KV head)
        run reaches `COPY_ENGINE_MIN_RUN_BYTES`.
        """
        num_tokens = keys.shape[2]
        end = start + num_tokens
        bs = self.block_size
        for seg in self.segments:
            lo, hi = max(start, seg.start_block * bs), min(end, (seg.start_block + seg.num_blocks) * bs)
            if lo >= hi:
                continue
            seg.ready(layer)
            for src, dst in ((keys, seg.keys[layer]), (values, seg.values[layer])):
                part = src[:, :, lo - start : hi - start]
                flat = dst.view(self.batch_size, self.num_kv_heads, seg.num_blocks * bs, self.head_dim)
                target = flat[:, :, lo - seg.start_block * bs : hi - seg.start_block * bs]
                if not (src.is_cuda and self.pin):
                    target.copy_(part)
                elif part.shape[2] * part.shape[3] * part.element_size() >= COPY_ENGINE_MIN_RUN_BYTES:
                    self._copy_runs(part, target)
                else:
                    self._write_rows(part, target)

    @staticmethod
    def _copy_runs(src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[b, h] = src[b, h]`` for every (sequence, KV head), one copy-engine transfer (``cudaMemcpyAsync``)
        each, on the current stream: long transfers between the GPU and pinned host memory (a prefill's write-back,
        a chunked prefill's read-back).

        A zero-copy kernel would hold every SM it is given for the whole PCIe transfer (about 21 ms per layer at
        8 x 32k tokens on Llama-8B's shape), at the write-back stream's high priority, where the prefill's own
        kernels should run; the copy engines move it beside them. `dst[b, h]` must be contiguous (the store's
        layout and a fresh device tensor are). A GPU `src` in another layout (the model's K/V are often (B, T, H_kv,
        D) in memory) is made contiguous one sequence at a time on the current stream (a temporary of ``H_kv * T *
        D`` elements, freed in stream order).
        """
        for b in range(src.shape[0]):
            rows = src[b]
            if rows.is_cuda and not rows[0].is_contiguous():
                rows = rows.contiguous()
            for h in range(src.shape[1]):
                dst[b, h].copy_(rows[h], non_blocking=True)

    def _write_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """One zero-copy launch: every (b, h, t) row of `src` (device) into `dst` (pinned host), same shape."""
        key = (tuple(src.shape), src.stride()[:3], dst.stride()[:3], src.device)
        offsets = self._row_offsets.get(key)
        if offsets is None:  # depends on shapes and strides only: built once per decode shape, not per step
            batch, heads, tokens, _ = src.shape
            dev = src.device
            b = torch.arange(batch, device=dev).view(-1, 1, 1)
            h = torch.arange(heads, device=dev).view(1, -1, 1)
            t = torch.arange(tokens, device=dev).view(1, 1, -1)
            offsets = tuple((b * x.stride(0) + h * x.stride(1) + t * x.stride(2)).reshape(-1) for x in (src, dst))
            if tokens <= _MEMO_MAX_TOKENS:
                self._row_offsets[key] = offsets
        copy_rows(src, offsets[0], dst, offsets[1], src.shape[-1])

    def write_at(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> None:
        """Store new tokens at positions ``start .. start + T - 1`` given as a 0-d device tensor.

        `keys`/`values`: (B, H_kv, T, D) CUDA tensors, last dim contiguous; the store must be pinned. One
        `write_tokens` launch per segment (K and V together, offsets computed in the kernel), on the current stream,
        no host synchronisation: the decode step captures this inside its CUDA graph.
        """
        for seg in self.segments:
            seg.ready(layer)
            write_tokens(keys, values, start, seg.keys[layer], seg.values[layer], seg.start_block)

    def _bh(self, batch: int, heads: int, device) -> torch.Tensor:
        key = (batch, heads, device)
        if key not in self._bh_cache:
            self._bh_cache[key] = torch.arange(batch * heads, device=device).view(batch, heads, 1)
        return self._bh_cache[key]

    # ---------------------------------------------------------------------------------------------------- fetch
    def fetch(
        self,
        layer: int,
        blocks: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor,
        backend: str,
        max_programs: int | None = None,
    ) -> None:
        """Copy blocks from host into pool slots: ``pool[b, h, slots[b,h,j]] = store[b, h, blocks[b,h,j]]``.

        `blocks`, `slots`, `valid`: (B, H_kv, N) on the pool's device; entries with ``valid == False`` are skipped.
        `pool_k`/`pool_v`: (B, H_kv, S, BS, D). One `gather_blocks` launch per segment (K and V together, the row
        offsets computed in the kernel from the plan), no host synchronisation.
        `max_programs`: cap on the gather kernel's programs (see `copy_rows`); background jobs pass
        `OasisConfig.fetch_programs`, a fetch inside the decode step passes None (the whole GPU).
        """
        if pool_k.is_cuda and not self.pin:
            raise RuntimeError(
                "the host store is not pinned, so the GPU cannot read it; set OasisConfig.pin_host_memory=True"
            )
        gather = gather_blocks if pool_k.is_cuda else gather_blocks_ref
        for seg in self.segments:
            seg.ready(layer)
            gather(seg.keys[layer], seg.values[layer], pool_k, pool_v, blocks, slots, valid, seg.start_block,
                   max_programs)

    def read_range(self, layer: int, num_tokens: int, device, values: bool = True):
        """K and V of positions ``0 .. num_tokens - 1`` of `layer`, each (B, H_kv, num_tokens, D) on `device`
        (V is None with ``values=False``).

        On CUDA with a pinned store, on the current stream (order it after the write-back of those rows): one
        zero-copy gather per segment and tensor, or, when each (sequence, KV head) run of a segment reaches
        `COPY_ENGINE_MIN_RUN_BYTES`, one copy-engine transfer per run (a chunked prefill reads earlier chunks while
        the previous layer's write-back may still be in flight; with both directions on the copy engines it ran
        fastest, see docs/results.md); otherwise plain copies."""
        device = torch.device(device)
        bs, batch, heads = self.block_size, self.batch_size, self.num_kv_heads
        nb = blocks_for(num_tokens, bs)
        shape = (batch, heads, nb, bs, self.head_dim)
        out_k = torch.empty(shape, dtype=self.dtype, device=device)
        out_v = torch.empty(shape, dtype=self.dtype, device=device) if values else None
        row = bs * self.head_dim
        for seg in self.segments:
            lo, hi = seg.start_block, min(seg.start_block + seg.num_blocks, nb)
            if lo >= hi:
                continue
            seg.ready(layer)
            long_runs = (hi - lo) * row * out_k.element_size() >= COPY_ENGINE_MIN_RUN_BYTES
            if device.type == "cuda" and self.pin and long_runs:
                for src, dst in ((seg.keys[layer], out_k), (seg.values[layer], out_v)):
                    if dst is not None:
                        self._copy_runs(src[:, :, : hi - lo], dst[:, :, lo:hi])
            elif device.type == "cuda" and self.pin:
                bh = self._bh(batch, heads, device)
                local = torch.arange(hi - lo, device=device)
                src_off = ((bh * seg.num_blocks + local) * row).reshape(-1)
                dst_off = ((bh * nb + lo + local) * row).reshape(-1)
                for src, dst in ((seg.keys[layer], out_k), (seg.values[layer], out_v)):
                    if dst is not None:
                        copy_rows(src, src_off, dst, dst_off, row)
            else:
                out_k[:, :, lo:hi] = seg.keys[layer][:, :, : hi - lo].to(device)
                if values:
                    out_v[:, :, lo:hi] = seg.values[layer][:, :, : hi - lo].to(device)
        flat = (batch, heads, nb * bs, self.head_dim)
        keys = out_k.view(flat)[:, :, :num_tokens]
        return keys, (out_v.view(flat)[:, :, :num_tokens] if values else None)

    def read_keys(self, layer: int, num_tokens: int) -> torch.Tensor:
        """All keys of `layer` up to `num_tokens` as one (B, H_kv, num_tokens, D) CPU tensor (oracle/tests; copies)."""
        return self.read_range(layer, num_tokens, "cpu", values=False)[0]
