"""`RemoteBlockStore`: a decode node's host tier when the full KV lives in a remote pool (Mooncake Store).

It stands where a `HostKVStore` stands in an `OasisCache` (same methods), but the decode node's host memory is
bounded and small:

- a **tail ring** of the last few blocks per layer, where each step's new K/V rows land (written by the GPU
  zero-copy kernel inside the captured decode step, as with the local store); a block that fills up is pushed to the
  pool by the next selection job of its layer;
- a **hot cache** of ``hot_blocks`` blocks (all layers together, least recently used out) that the selection jobs
  pull into from the pool, with one batched get per job for the misses; the GPU gathers the delta from it.

One pool object per (request, layer, block) holds K and V of that block for the whole batch and every KV head
(``2 * B * H_kv * block_size * head_dim`` elements): one fetch per block per layer, whatever heads chose it.

The pool is reached only from the selection jobs of an asynchronous selector (``lookahead``, ``previous-query``),
on the prefetch worker: the network is never on the decode step's critical path, and a job that is still pulling
when its layer's next step starts is a counted late job (the step waits; the output never changes).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from oasis_hf.cache.pinned import PinnedBuffer
from oasis_hf.config import blocks_for
from oasis_hf.errors import UnsupportedError
from oasis_hf.kernels import copy_rows, copy_rows_ref
from oasis_hf.remote.mooncake import MooncakeTier

logger = logging.getLogger(__name__)


def block_key(request: str, layer: int, block: int) -> str:
    return f"{request}/L{layer}/B{block}"


def meta_key(request: str) -> str:
    return f"{request}/meta"


def state_key(request: str, layer: int) -> str:
    """A layer's published tables and block summaries (small: one key per block, not the keys)."""
    return f"{request}/L{layer}/state"


class RemoteBlockStore:
    """Host tier of a decode node: tail ring + hot-block cache in front of a `MooncakeTier`.

    Parameters
    ----------
    tier : the connected client.
    request : the request id the prefill node published under.
    layer_ids, batch_size, num_kv_heads, head_dim, block_size, dtype : the published KV layout.
    pin : page-lock the ring and the hot cache (CUDA: the GPU reads and writes them directly).
    ring_blocks : blocks per (sequence, head, layer) in the tail ring; must cover the recent window plus one forward.
    hot_blocks : blocks (of all layers) the hot cache holds; at least the most blocks one job fetches.
    capacity_blocks : logical blocks addressable at attach (grows as the sequence does; nothing is allocated).
    pushed_blocks : blocks per layer already complete in the pool (the prompt's full blocks).
    free_on_close : remove the request's objects from the pool in `close` (the request is finished).
    ahead_blocks : network prefetch, per layer and step: the best-scoring blocks just below the budget's cut (the
        likeliest to enter in the next steps) are pulled into the hot cache by a background network thread, so a
        later job finds them hot instead of waiting on the network. 0 disables it.
    """

    capturable_fetch = False  # a fetch waits on the network: selection jobs run eagerly on the worker
    reusable = False  # the pool objects belong to one request: `OasisCache.reset` releases the store

    def __init__(self, tier: MooncakeTier, request: str, layer_ids: list[int], batch_size: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, pin: bool, ring_blocks: int, hot_blocks: int,
                 capacity_blocks: int, pushed_blocks: int, free_on_close: bool = True,
                 ahead_blocks: int = 0) -> None:  # fmt: skip
        self.tier, self.request = tier, request
        self.layer_ids = list(layer_ids)
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, head_dim
        self.block_size, self.dtype, self.pin = block_size, dtype, pin
        self.ring_blocks, self.hot_blocks = ring_blocks, hot_blocks
        self.capacity_blocks = capacity_blocks
        self.free_on_close = free_on_close
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.block_elems = batch_size * num_kv_heads * block_size * head_dim  # K (or V) of one block
        ring_shape = (len(self.layer_ids), 2, batch_size, num_kv_heads, ring_blocks, block_size, head_dim)
        ring_bytes = self.elem * int(torch.Size(ring_shape).numel())
        hot_bytes = hot_blocks * 2 * self.block_elems * self.elem
        self._buffer = PinnedBuffer(ring_bytes + hot_bytes + 2 * self.block_elems * self.elem, pin=pin)
        self.ring = self._buffer.view(0, ring_shape, dtype)
        self.hot = self._buffer.view(ring_bytes, (hot_blocks, 2, batch_size, num_kv_heads, block_size, head_dim),
                                     dtype)
        self._push = self._buffer.view(ring_bytes + hot_bytes, (2, batch_size, num_kv_heads, block_size, head_dim),
                                       dtype)
        tier.register(self._buffer.data.data_ptr(), self._buffer.data.numel())  # gets land here, pushes leave here
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}
        self._hot_of: collections.OrderedDict[tuple[int, int], int] = collections.OrderedDict()  # LRU, newest last
        self._pushed = {layer: pushed_blocks for layer in self.layer_ids}
        self._prompt_blocks = pushed_blocks
        self._ends: dict[int, collections.deque] = {layer: collections.deque() for layer in self.layer_ids}
        self._lock = threading.Lock()  # jobs of several devices' workers and the network thread share the hot cache
        self._cond = threading.Condition(self._lock)  # signalled when an ahead pull lands (or fails)
        self._loading: set[tuple[int, int]] = set()  # hot-cache keys an ahead pull is writing
        self._ahead_unused: set[tuple[int, int]] = set()  # pulled ahead, not yet used by a fetch
        self._in_use: set[int] = set()  # entries a fetch has resolved and will gather from
        self._gathered: dict[torch.device, torch.cuda.Event] = {}
        self.ahead_blocks = ahead_blocks
        self._closed = False
        self._net_queue: collections.deque = collections.deque()
        self._net_thread: threading.Thread | None = None
        self._net_error: BaseException | None = None
        self.pulled_blocks = self.pulled_bytes = self.hot_hits = self.pushed_count = 0
        self.ahead_pulled = self.ahead_hits = 0
        self.pull_seconds = self.net_wait_seconds = 0.0

    # ------------------------------------------------------------------------------------------ HostKVStore API
    def bytes_per_block(self) -> int:
        return 2 * self.block_elems * self.elem

    @property
    def nbytes(self) -> int:
        """Host bytes this decode node holds for the request: ring + hot cache + push staging."""
        return self._buffer.data.numel()

    def ensure_capacity(self, num_tokens: int, reserve_tokens: int = 0) -> bool:
        needed = blocks_for(max(num_tokens, reserve_tokens), self.block_size)
        if needed <= self.capacity_blocks:
            return False
        self.capacity_blocks = max(needed, self.capacity_blocks + self.capacity_blocks // 2)
        return True  # logical only: the pool holds the blocks, the layers grow their tables

    def release(self) -> None:
        """Free the local buffers (and the request's pool objects when `free_on_close`)."""
        self.close()

    def note_step(self, layer: int, end: int) -> None:
        """The layer's sequence reaches `end` tokens with the forward whose selection job comes next."""
        self._ends[layer].append(end)

    def truncate(self, layer: int, length: int) -> None:
        """The layer now holds `length` tokens (rejected drafts cropped): blocks past it must be pushed again when
        they complete, and hot copies of them are stale."""
        complete = length // self.block_size
        if complete < self._prompt_blocks:
            raise UnsupportedError(
                f"cannot crop a remote-attached cache to {length} tokens, inside the published prompt "
                f"({self._prompt_blocks * self.block_size}+ tokens): its rows are only in the pool"
            )
        with self._cond:
            self._cond.wait_for(lambda: not self._loading)
            self._pushed[layer] = min(self._pushed[layer], complete)
            for key in [k for k in self._hot_of if k[0] == layer and k[1] >= complete]:
                del self._hot_of[key]
                self._ahead_unused.discard(key)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """New rows (B, H_kv, T, D) at positions ``start ..`` into the tail ring (eager write-back)."""
        num_tokens = keys.shape[2]
        if num_tokens > (self.ring_blocks - 1) * self.block_size:
            raise UnsupportedError(
                f"a forward of {num_tokens} tokens does not fit the decode node's tail ring of {self.ring_blocks} "
                "blocks; a remote-attached OasisCache decodes (prefill runs on the prefill node)"
            )
        start_t = torch.full((), start, dtype=torch.long, device=keys.device)
        self.write_at(layer, keys, values, start_t)

    def write_at(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> None:
        """As `write`, with `start` a 0-d device tensor (fixed shapes: captured in the decode step's graph)."""
        batch, heads, num_tokens, head_dim = keys.shape
        dev = keys.device
        bs, ring = self.block_size, self.ring_blocks
        pos = start + torch.arange(num_tokens, device=dev)
        b = torch.arange(batch, device=dev).view(-1, 1, 1)
        h = torch.arange(heads, device=dev).view(1, -1, 1)
        t = torch.arange(num_tokens, device=dev)
        dst_row = (((b * heads + h) * ring + (pos // bs) % ring) * bs + pos % bs).reshape(-1)
        plane = batch * heads * ring * bs * head_dim  # elements of one (layer, K-or-V) ring
        base = self._index[layer] * 2 * plane
        for i, src in enumerate((keys, values)):
            src_off = (b * src.stride(0) + h * src.stride(1) + t * src.stride(2)).reshape(-1)
            dst_off = base + i * plane + dst_row * head_dim
            if src.is_cuda:
                copy_rows(src, src_off, self.ring, dst_off, head_dim)
            else:
                copy_rows_ref(src, src_off, self.ring, dst_off, head_dim)

    def read_range(self, layer: int, num_tokens: int, device, values: bool = True):
        raise UnsupportedError(
            "a remote-attached OasisCache decodes: long forwards (prefill chunks) run on the prefill node, which "
            "publishes the result"
        )

    def read_keys(self, layer: int, num_tokens: int) -> torch.Tensor:
        raise UnsupportedError(
            "a remote-attached OasisCache does not hold all keys, so measure_recall and the oracle selector are "
            "not available on the decode node; measure them on a local OasisCache"
        )

    def fetch(self, layer: int, blocks: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
              slots: torch.Tensor, valid: torch.Tensor, backend: str,
              max_programs: int | None = None) -> None:  # fmt: skip
        """``pool[b, h, slots[b,h,j]] = block blocks[b,h,j]`` where `valid`, pulling misses from the pool.

        Runs in a selection job (prefetch worker): synchronises its stream to read the plan, pushes the layer's newly
        completed blocks first (a block is fetched only after it was evicted, which is after it completed), then
        pulls the blocks not in the hot cache (one batched get) and gathers the delta in one launch per tensor.
        """
        if pool_k.is_cuda:
            torch.cuda.current_stream(pool_k.device).synchronize()
        ends = self._ends[layer]
        end = ends.popleft() if ends else None
        with self._cond:
            if self._net_error is not None:
                raise self._net_error
            if end is not None:
                self._push_completed(layer, end)
            wanted = valid.cpu()
            if not bool(wanted.any()):
                return
            needed = sorted(set(blocks.cpu()[wanted].tolist()))
            for lo in range(0, len(needed), self.hot_blocks):
                chunk = needed[lo : lo + self.hot_blocks]
                entry = self._load(layer, chunk)
                self._gather(chunk, entry, blocks, pool_k, pool_v, slots, valid, max_programs)

    def prefetch_hint(self, layer: int, scores: torch.Tensor, num_slots: int) -> None:
        """After a job's plan: queue network pulls of the best blocks ranked just below the top `num_slots` of
        `scores` (B, H_kv, NB) into the hot cache (at most `ahead_blocks`, complete blocks only, not already hot)."""
        if self.ahead_blocks <= 0 or self._closed:
            return
        pairs = scores.shape[0] * scores.shape[1]
        depth = min(scores.shape[-1], num_slots + -(-self.ahead_blocks // pairs))
        top = scores.topk(depth, dim=-1)
        ranks = top.indices[..., num_slots:].cpu().permute(2, 0, 1).reshape(-1).tolist()  # rank-major order
        ok = (top.values[..., num_slots:] > float("-inf")).cpu().permute(2, 0, 1).reshape(-1).tolist()
        with self._cond:
            limit = self._pushed[layer]
            wanted = []
            for blk, fine in zip(ranks, ok, strict=True):
                if fine and blk < limit and (layer, blk) not in self._hot_of and blk not in wanted:
                    wanted.append(blk)
                if len(wanted) == self.ahead_blocks:
                    break
            if not wanted:
                return
            self._sync_gathers()
            entries = self._assign_entries(layer, wanted, keep=set())
            if entries is None:  # every entry is busy: skip this hint
                return
            for blk in wanted:
                self._loading.add((layer, blk))
            self._net_queue.append((layer, wanted, entries))
            if self._net_thread is None:
                self._net_thread = threading.Thread(target=self._net_loop, name=f"oasis-net-{self.request}")
                self._net_thread.start()
            self._cond.notify_all()

    def attach_tail(self, layer: int, block: int, data: torch.Tensor) -> None:
        """Put the prompt's partial last block (2, B, H_kv, BS, D) into the ring (attach)."""
        self.ring[self._index[layer], :, :, :, block % self.ring_blocks] = data

    def close(self) -> None:
        """Remove the request's pool objects (when `free_on_close`) and free the local buffers; idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._net_thread is not None:
            self._net_thread.join()
        for event in self._gathered.values():
            event.synchronize()
        self.tier.unregister(self._buffer.data.data_ptr())
        self._buffer.release()
        if self.free_on_close:
            self.tier.remove(self.request_keys())

    def request_keys(self) -> list[str]:
        """Every pool key of this request (the blocks up to the current capacity, and the metadata)."""
        keys = [block_key(self.request, layer, blk) for layer in self.layer_ids for blk in range(self.capacity_blocks)]
        return keys + [state_key(self.request, layer) for layer in self.layer_ids] + [meta_key(self.request)]

    # ------------------------------------------------------------------------------------------ internals
    def _push_completed(self, layer: int, end: int) -> None:
        """Write the layer's blocks that completed up to `end` tokens from the ring to the pool (upsert: the
        prompt's partial last block was published before it filled)."""
        complete = end // self.block_size
        ring = self.ring[self._index[layer]]  # (2, B, H, R, BS, D)
        for blk in range(self._pushed[layer], complete):
            self._push.copy_(ring[:, :, :, blk % self.ring_blocks])
            self.tier.put([block_key(self.request, layer, blk)], [self._push.data_ptr()],
                          [self._push.numel() * self.elem], overwrite=True)
            self.pushed_count += 1
        self._pushed[layer] = max(self._pushed[layer], complete)

    def _sync_gathers(self) -> None:
        for event in self._gathered.values():  # earlier gathers may still read entries about to be overwritten
            event.synchronize()

    def _assign_entries(self, layer: int, blocks: list[int], keep: set) -> dict[int, int] | None:
        """Hot-cache entries for `blocks` (not hot yet): free ones first, then the least recently used that is not
        being pulled, not about to be gathered from and not in `keep`. None if there are not enough."""
        busy = set(self._in_use) | {self._hot_of[k] for k in self._loading if k in self._hot_of}
        free = sorted(set(range(self.hot_blocks)) - set(self._hot_of.values()))
        victims = [k for k in self._hot_of if k not in keep and k not in self._loading and self._hot_of[k] not in busy]
        if len(free) + len(victims) < len(blocks):
            return None
        entries = {}
        for blk in blocks:
            if free:
                slot = free.pop()
            else:
                victim = victims.pop(0)
                slot = self._hot_of.pop(victim)
                self._ahead_unused.discard(victim)
            self._hot_of[(layer, blk)] = entries[blk] = slot
        return entries

    def _load(self, layer: int, chunk: list[int]) -> dict[int, int]:
        """Make the blocks of `chunk` hot (call with the lock held); returns block -> hot-cache entry."""
        if any((layer, blk) in self._loading for blk in chunk):
            t0 = time.perf_counter()
            self._cond.wait_for(lambda: self._net_error is not None
                                or not any((layer, blk) in self._loading for blk in chunk))
            self.net_wait_seconds += time.perf_counter() - t0
        if self._net_error is not None:
            raise self._net_error
        self._sync_gathers()
        entry: dict[int, int] = {}
        misses = []
        for blk in chunk:
            key = (layer, blk)
            if key in self._hot_of:
                self._hot_of.move_to_end(key)
                entry[blk] = self._hot_of[key]
                self.hot_hits += 1
                if key in self._ahead_unused:
                    self._ahead_unused.discard(key)
                    self.ahead_hits += 1
            else:
                misses.append(blk)
        self._in_use = set(entry.values())
        assigned = self._assign_entries(layer, misses, keep={(layer, blk) for blk in chunk})
        if assigned is None:  # ahead pulls hold the rest: let them land, then take any entry
            self._cond.wait_for(lambda: not self._loading or self._net_error is not None)
            if self._net_error is not None:
                raise self._net_error
            assigned = self._assign_entries(layer, misses, keep={(layer, blk) for blk in chunk})
        entry.update(assigned)
        self._in_use = set()
        if misses:
            t0 = time.perf_counter()
            size = 2 * self.block_elems * self.elem
            self.tier.get([block_key(self.request, layer, blk) for blk in misses],
                          [self.hot[entry[blk]].data_ptr() for blk in misses], [size] * len(misses))
            self.pull_seconds += time.perf_counter() - t0
            self.pulled_blocks += len(misses)
            self.pulled_bytes += size * len(misses)
        return entry

    def _net_loop(self) -> None:
        """The network thread: pull queued ahead blocks into their hot-cache entries (no lock held while pulling)."""
        size = 2 * self.block_elems * self.elem
        while True:
            with self._cond:
                # Poll, so a store that is never closed does not keep the interpreter from exiting.
                while not (self._net_queue or self._closed) and threading.main_thread().is_alive():
                    self._cond.wait(timeout=0.2)
                if self._closed or not threading.main_thread().is_alive():
                    for layer, blocks, _ in self._net_queue:
                        for blk in blocks:
                            self._loading.discard((layer, blk))
                            self._hot_of.pop((layer, blk), None)
                    self._net_queue.clear()
                    self._cond.notify_all()
                    return
                layer, blocks, entries = self._net_queue.popleft()
            try:
                self.tier.get([block_key(self.request, layer, blk) for blk in blocks],
                              [self.hot[entries[blk]].data_ptr() for blk in blocks], [size] * len(blocks))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the next fetch
                logger.error("ahead pull failed: %r", exc)
                with self._cond:
                    self._net_error = exc
                    for blk in blocks:
                        self._loading.discard((layer, blk))
                        self._hot_of.pop((layer, blk), None)
                    self._cond.notify_all()
                continue
            with self._cond:
                for blk in blocks:
                    self._loading.discard((layer, blk))
                    self._ahead_unused.add((layer, blk))
                self.ahead_pulled += len(blocks)
                self.pulled_bytes += size * len(blocks)
                self._cond.notify_all()

    def _gather(self, chunk, entry, blocks, pool_k, pool_v, slots, valid, max_programs=None) -> None:
        batch, heads, _ = blocks.shape
        dev = pool_k.device
        row = self.block_size * self.head_dim
        lookup = torch.full((max(chunk) + 2,), -1, dtype=torch.long)
        lookup[torch.tensor(chunk)] = torch.tensor([entry[blk] for blk in chunk])
        lookup = lookup.to(dev)
        in_chunk = valid & (blocks <= max(chunk))
        ent = torch.where(in_chunk, lookup[blocks.clamp(0, max(chunk) + 1)], -1)
        bh = torch.arange(batch * heads, device=dev).view(batch, heads, 1)
        dst_off = ((bh * pool_k.shape[2] + slots) * row).reshape(-1)
        for i, dst in enumerate((pool_k, pool_v)):
            src_off = torch.where(ent >= 0, ((ent * 2 + i) * batch * heads + bh) * row, -1).reshape(-1)
            if dst.is_cuda:
                copy_rows(self.hot, src_off, dst, dst_off, row, max_programs)
            else:
                copy_rows_ref(self.hot, src_off, dst, dst_off, row)
        if pool_k.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            self._gathered[dev] = event
