"""`OasisLayer`: one full-attention layer of an `OasisCache`, and the orchestrator of its forwards.

``update`` (called by the attention module) appends the new K/V to the host store and returns the new tokens,
marked with a reference to this layer; the ``"oasis"`` attention function then calls `attend`, which dispatches:

- **prefill** (the first forward on an empty cache, or a long chunk on a non-empty one): `oasis_hf.cache.prefill`;
- **decode / verification** (``T`` new tokens on a non-empty cache): `OasisLayer.decode_step`. The append (new
  blocks get slots, evicting the least important unpinned block; the new tokens go into the pool; the touched
  summaries are recomputed) and the sparse attention over the resident blocks plus the new tokens. Where the step
  selects (a synchronous selector, or with `OasisConfig.sync_fetch_blocks` a capped correction of an asynchronous
  one) the append is its own `append_tokens` launch, followed by the scores (`scoring.block_scores`), the planned
  delta (`scoring.plan`) and the fetch of the misses from host; otherwise it runs in the attention's merge launch,
  after the attention, which read the new tokens from the step's K/V (a block it evicts was still attended in this
  step). ``static`` selects nothing in the step: the append evicts the oldest unpinned block for a new one, which
  keeps its set (the sinks and the latest blocks) as it is; a crop refetches what the dropped blocks had evicted.
  On CUDA the step is a captured graph per ``T`` (`oasis_hf.cache.step_graphs`); an asynchronous selector's job
  (`oasis_hf.cache.selection_jobs`) runs score, plan and fetch after the step, for the next one;
- **whole-step** (inside `oasis_hf.DecodeGraph`'s forward): the same device work reading the step's position from
  device memory, the job forked onto the prefetch stream (`_graph_step`).

Per (sequence, KV head) the pool never holds more than ``S`` blocks (the layer's budget over ``block_size``): the
sinks (first real blocks), the recent window (last blocks, new tokens included) and the selected blocks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from oasis_hf.cache import scoring
from oasis_hf.cache.block_table import BlockTable
from oasis_hf.cache.prefill import prefill, prefill_chunk
from oasis_hf.cache.selection_jobs import SelectionJobs
from oasis_hf.cache.step_graphs import GRAPH_MAX_TOKENS, StepGraphs, graphable
from oasis_hf.cache.summaries import BlockSummaries
from oasis_hf.errors import DeviceMemoryError, OasisError, UnsupportedError
from oasis_hf.kernels import append_tokens, append_tokens_ref, sparse_attention, sparse_attention_ref, use_triton
from oasis_hf.kernels.ref import AppendState

if TYPE_CHECKING:
    from oasis_hf.cache.oasis_cache import OasisCache

__all__ = ["GRAPH_MAX_TOKENS", "OasisLayer", "WindowLayer", "layer_of", "windowed"]

logger = logging.getLogger(__name__)

_HANDLE_ATTR = "_oasis_layer"
_WINDOW_ATTR = "_oasis_window"


def windowed(key: torch.Tensor) -> bool:
    """Whether `key` was returned by one of an `OasisCache`'s sliding-window layers (the last W tokens only)."""
    return getattr(key, _WINDOW_ATTR, False)


class WindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window cache layer, whose returned keys say so (`windowed`): the attention function
    refuses them for a model layer that attends over the whole sequence (a cache built for other layer types)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        handle = keys.view(keys.shape)  # a distinct tensor object over the same memory
        setattr(handle, _WINDOW_ATTR, True)
        return handle, values


def layer_of(key: torch.Tensor) -> OasisLayer | None:
    """The `OasisLayer` whose ``update`` returned `key`, or None for any other tensor."""
    return getattr(key, _HANDLE_ATTR, None)


class OasisLayer(CacheLayerMixin):
    """A full-attention layer whose KV lives in host memory with a capped block pool on the device."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: OasisCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)  # the cache owns its layers: no cycle, a dropped cache is freed at once
        self.layer_idx = layer_idx
        self.config = cache.config
        #: Block slots per (sequence, KV head) on the GPU: ``S`` (`OasisConfig.layer_budget_blocks`).
        self.budget_blocks = cache.config.layer_budget_blocks(layer_idx)
        self.length = 0
        self._pending: tuple | None = None  # this forward's (start, end, chunk), or ("whole-step", start, end)
        self._deferred_write = False  # this forward's host write-back runs inside the decode step
        self.kv_start: torch.Tensor | None = None  # (B,) first real position (left padding)
        self.writeback_event = None
        self._aranges: dict[int, torch.Tensor] = {}
        self.step_graphs = StepGraphs()  # T -> captured decode step (CUDA)
        self.jobs = SelectionJobs(self)  # the selection jobs of an asynchronous selector
        #: Decode forwards this layer ran since its prefill (eager or in a `DecodeGraph`): with
        #: `OasisConfig.selection_interval` N, the selection job follows forwards 0, N, 2N, ...
        self.decode_forwards = 0

    @property
    def cache(self) -> OasisCache:
        """The `OasisCache` this layer belongs to (held weakly)."""
        cache = self._cache()
        if cache is None:
            raise OasisError(f"OasisCache layer {self.layer_idx} outlived its cache, which was garbage-collected; "
                             "keep a reference to the OasisCache while its layers are in use")
        return cache

    # ------------------------------------------------------------------------------------------ HF layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        self.batch_size, self.num_kv_heads, _, self.head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        shape = (self.batch_size, self.num_kv_heads, self.budget_blocks, cfg.block_size, self.head_dim)
        try:
            self.pool_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.pool_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError as exc:
            nbytes = 2 * math.prod(shape) * key_states.element_size()
            raise DeviceMemoryError(
                f"OasisCache layer {self.layer_idx}: the block pool needs {nbytes / 2**20:.1f} MiB on {self.device} "
                "and the allocation failed; lower OasisConfig.budget_tokens (or this layer's "
                "layer_budget_tokens) or the batch size"
            ) from exc
        capacity = max(self.budget_blocks, self.cache.host_capacity_blocks)
        self.table = BlockTable(self.batch_size, self.num_kv_heads, self.budget_blocks, capacity, self.device)
        self.summaries = BlockSummaries(
            cfg.summary, self.batch_size, self.num_kv_heads, capacity, self.head_dim, self.dtype, self.device,
            cfg.block_size,
        )
        # Selection memory (`OasisConfig.score_decay`): every block's remembered score, (B, H_kv, NB_cap) float32.
        self.score_memory = torch.zeros(self.batch_size, self.num_kv_heads, capacity, device=self.device)
        self.keys, self.values = self.pool_k, self.pool_v
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `key_states`/`value_states` (B, H_kv, T, D); returns them, marked for the oasis attention."""
        if self._pending is not None:
            raise UnsupportedError(
                f"OasisCache layer {self.layer_idx} was updated twice without its attention running: the model is "
                "not using the 'oasis' attention implementation, so it would read only the new tokens. Call "
                "oasis_hf.register() and model.set_attn_implementation('oasis') (or oasis_hf.enable(model))."
            )
        if self.is_initialized and self.length == 0 and not self._fits(key_states):
            self.cache.relayout()  # a reset cache fed another batch shape (or mode): every layer allocates anew
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_kv_heads:
            raise UnsupportedError(
                f"OasisCache layer {self.layer_idx} holds batch {self.batch_size} x {self.num_kv_heads} KV heads but "
                f"got {tuple(key_states.shape[:2])}; use a fresh OasisCache per batch (beam search and batch "
                "expansion are not supported)"
            )
        if self.cache.in_whole_step:  # a whole-model decode step (`oasis_hf.DecodeGraph`): see `_graph_step`
            self._pending = ("whole-step", self.length, self.length + key_states.shape[2])
            handle = key_states.view(key_states.shape)
            setattr(handle, _HANDLE_ATTR, self)
            return handle, value_states
        cfg = self.config
        start, end = self.length, self.length + key_states.shape[2]
        chunk = False
        if start > 0:
            # A prefill chunk (more than dense_chunk_tokens new tokens, or more new blocks than the budget holds)
            # attends exactly over the whole sequence read back from host; shorter forwards (decode, draft
            # verification) take the sparse step.
            forced = cfg.sink_blocks + max(cfg.recent_blocks, cfg.blocks(end) - start // cfg.block_size)
            chunk = forced > self.budget_blocks or end - start > cfg.dense_chunk_tokens
        self.cache.reserve(end)
        # A forward that will run as a captured graph writes its rows to host inside the graph; anything else
        # (prefill, CPU, eager steps) writes back here, on a side stream.
        self._deferred_write = start > 0 and not chunk and graphable(self, key_states)
        if not self._deferred_write:
            self.cache.write_back(self, key_states, value_states, start)
        self.length = end
        self._pending = (start, end, chunk)
        handle = key_states.view(key_states.shape)  # a distinct tensor object over the same memory
        setattr(handle, _HANDLE_ATTR, self)
        return handle, value_states

    @property
    def mid_forward(self) -> bool:
        """Whether this layer received a forward's K/V whose attention has not run (an interrupted forward)."""
        return self._pending is not None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (HF >= 5.18 convention: a non-positive count)."""
        if tokens_to_remove > 0:
            raise ValueError("OasisLayer.crop takes a non-positive count; OasisCache.crop converts both conventions")
        if tokens_to_remove == 0 or self.length == 0:
            return
        self.jobs.await_job()  # the job rewrites the table that crop edits
        self.jobs.stage_pending = False  # a proposal may name blocks that no longer exist
        blocks_before = self.config.blocks(self.length)
        self.length = max(0, self.length + tokens_to_remove)
        if self.cache.host is not None:
            self.cache.host.truncate(self.layer_idx, self.length)
        self._pending = None
        if self.length == 0:
            self.reset()
            return
        self.table.drop_from(self.config.blocks(self.length))
        if self.keeps_latest and self.config.blocks(self.length) < blocks_before:  # a dropped block took a slot
            self._refill_latest()

    @property
    def keeps_latest(self) -> bool:
        """Whether this layer's selection is the sinks plus the latest blocks (a synchronous ``recency`` selector:
        ``static``), kept by `append_tokens` evicting the oldest unpinned block, with no selection in the step."""
        selector = self.cache.selector
        return selector.scoring == "recency" and not selector.asynchronous

    def _refill_latest(self) -> None:
        """After a crop, refetch the older blocks that the dropped ones had evicted, so that a `keeps_latest` layer
        holds the sinks plus the latest blocks again (its steps only ever add the newest block)."""
        if self.writeback_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.writeback_event)
            self.writeback_event = None
        last = torch.full((), self.length - 1, dtype=torch.long, device=self.device)
        rows = self.pool_k.new_zeros(self.batch_size, self.num_kv_heads, 1, self.head_dim)  # recency reads no query
        blocks, slots, valid = scoring.plan(self, scoring.block_scores(self, rows, 1.0, last), None)
        self.cache.host.fetch(self.layer_idx, blocks, self.pool_k, self.pool_v, slots, valid,
                              self.config.kernel_backend)

    def reset(self) -> None:
        """Forget every token and keep the allocations: the pool, table, summaries, selection memory and padding
        starts are emptied in place (the next prefill writes into them), so the captured step and job graphs, which
        address them, stay valid for a next batch of the same shape. A forward interrupted mid-way drops them."""
        self.jobs.await_job()
        if self._pending is not None:  # interrupted: a capture may have stopped half-way
            self.step_graphs.clear()
            self.jobs.clear()
        self.jobs.stage_pending = False
        self.length = 0
        self.decode_forwards = 0
        self._pending = None
        if self.is_initialized:
            with torch.inference_mode(self.pool_k.is_inference()):  # in the mode the buffers were made in
                self.table.reset()
                self.summaries.zero_()
                self.score_memory.zero_()

    def _fits(self, key_states: torch.Tensor) -> bool:
        """Whether this layer's buffers hold K/V shaped as `key_states` (B, H_kv, T, D) (batch, heads, head dim,
        dtype, device) and take in-place writes in the current mode (buffers made under ``torch.inference_mode``
        refuse them outside it)."""
        batch, heads, _, head_dim = key_states.shape
        return ((batch, heads, head_dim) == (self.batch_size, self.num_kv_heads, self.head_dim)
                and key_states.dtype == self.dtype and key_states.device == self.device
                and self.pool_k.is_inference() == torch.is_inference_mode_enabled())

    def release_buffers(self) -> None:
        """Drop this empty layer's buffers and graphs; its next ``update`` allocates them anew
        (`OasisCache.relayout`)."""
        self.step_graphs.clear()
        self.jobs.before_grow()
        self.kv_start = self.pool_k = self.pool_v = self.keys = self.values = None  # freed before the new ones
        self.table = self.summaries = self.score_memory = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedError("OasisCache does not support beam search; use greedy or sampling (num_beams=1)")

    def restore(self, state: dict, device: torch.device) -> None:
        """Initialise from a published prefill state (`oasis_hf.remote.publish`) instead of a prefill forward: the
        tables, summaries, selection memory, padding starts and length; the pool stays empty until the caller
        fetches the resident blocks into it (their slots are in the table)."""
        batch, heads, head_dim = state["batch_size"], state["num_kv_heads"], state["head_dim"]
        dtype = getattr(torch, state["dtype"])
        dummy = torch.empty(batch, heads, 0, head_dim, dtype=dtype, device=device)
        self.lazy_initialization(dummy, dummy)
        capacity = state["block_slot"].shape[-1]
        self.table.block_slot[..., :capacity] = state["block_slot"].to(device)
        self.table.slot_block.copy_(state["slot_block"].to(device))
        self.table.slot_score.copy_(state["slot_score"].to(device))
        self.summaries.data[..., :capacity, :] = state["summaries"].to(device)
        if self.summaries.codes is not None:
            if "codes" not in state:
                raise ValueError("the published prefill has no key codes but this cache's summary is 'quantized'; "
                                 "publish it with the same OasisConfig.summary")
            self.summaries.codes[:, :, :capacity] = state["codes"].to(device)
        if "score_memory" in state:  # publications before the selection memory have none: it starts empty
            self.score_memory[..., :capacity] = state["score_memory"].to(device)
        self.kv_start = state["kv_start"].to(device)
        self.length = state["length"]

    def grow(self, capacity_blocks: int) -> None:
        """Address `capacity_blocks` logical blocks (called when the host store grows)."""
        if self.is_initialized:
            # Captured steps and jobs address the old tables and host segments. The next step and job of each T run
            # eagerly (allocating, and compiling the kernel variants of the new table size: `plan_blocks` and
            # `score_blocks` specialise on it) before they are captured again: a compilation inside a capture
            # invalidates it. A pending stale proposal is committed first (it addresses the old capacity).
            self.step_graphs.clear()
            self.jobs.before_grow()
            self.table.grow(capacity_blocks)
            self.summaries.grow(capacity_blocks)
            held = self.score_memory.shape[-1]
            if self.table.capacity_blocks > held:
                grown = self.score_memory.new_zeros(*self.score_memory.shape[:2], self.table.capacity_blocks)
                grown[..., :held] = self.score_memory
                self.score_memory = grown

    @property
    def device_nbytes(self) -> int:
        """GPU bytes of this layer: pool + summaries + tables (the selection memory counted with them)."""
        if not self.is_initialized:
            return 0
        tables = sum(t.numel() * t.element_size() for t in (self.table.slot_block, self.table.block_slot,
                                                             self.table.slot_score, self.score_memory))
        return 2 * self.pool_k.numel() * self.pool_k.element_size() + self.summaries.nbytes + tables

    # ------------------------------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scale: float
    ) -> torch.Tensor:
        """Attention of this forward's queries (B, H_q, T, D); returns (B, T, H_q, D)."""
        if self._pending is None:
            raise RuntimeError(f"OasisCache layer {self.layer_idx}: attention ran without a matching update")
        if self._pending[0] == "whole-step":
            self._pending = None
            return self._graph_step(query, key, value, scale)
        start, end, chunk = self._pending
        self._pending = None
        if start == 0:
            return prefill(self, query, key, value, attention_mask, scale, end)
        if chunk:
            return prefill_chunk(self, query, key, value, attention_mask, scale, start, end)
        return self._decode(query, key, value, scale, start)

    def exact_block_mass(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """(B, H_kv, NB_cap): exact softmax attention mass of `query` (B, H_q, T, D) per block, from the full keys on
        host (the ``oracle`` selector's scores)."""
        return scoring.exact_block_mass(self, query, scale)

    def drop_rejected(self, tokens: int) -> None:
        """The last `tokens` of the latest forward were rejected drafts (see `SelectionJobs.drop_rejected`)."""
        self.jobs.drop_rejected(tokens)

    def arange(self, n: int) -> torch.Tensor:
        """(n,) long arange on the layer's device, memoised."""
        ids = self._aranges.get(n)
        if ids is None:
            ids = self._aranges[n] = torch.arange(n, device=self.device)
        return ids

    def graph_pool(self, device: torch.device, kind: str):
        """The memory pool of one of this layer's live graphs of `kind` (``"step"`` or ``"job"``) on `device`, or
        None."""
        return (self.step_graphs if kind == "step" else self.jobs).pool(device)

    def _decode(self, query, key, value, scale, start) -> torch.Tensor:
        self.cache.stats.decode_layer_steps += 1
        if self.config.prefetch_policy == "stale" and self.cache.selector.asynchronous:
            self.jobs.commit_staged()  # the previous step's proposal, if its job is done; never waits
        else:
            self.jobs.await_job()  # the previous step's selection job rewrote this layer's table and pool
        if self.writeback_event is not None:  # host rows written on the side stream before any block is read back
            torch.cuda.current_stream(self.device).wait_event(self.writeback_event)
            self.writeback_event = None  # later work on this stream stays ordered after the wait
        if self._deferred_write:
            out, query_src, start_src, graphed = self.step_graphs.run(self, query, key, value, scale, start)
        else:
            start_src = torch.full((), start, dtype=torch.long, device=self.device)
            query_src, graphed = query, False
            out = self.decode_step(query, key, value, start_src, scale, write_back=False)
        if self.config.measure_recall:
            scoring.measure_recall(self, query, scale)
        if self.job_due():
            self.jobs.submit(query_src, start_src, query.shape[2], scale, graphed)
        self.decode_forwards += 1
        return out

    def job_due(self) -> bool:
        """Whether this layer's next decode forward is followed by a selection job: an asynchronous selector, on
        every `OasisConfig.selection_interval`-th forward."""
        return self.cache.selector.asynchronous and self.decode_forwards % self.config.selection_interval == 0

    def _graph_step(self, query, key, value, scale: float) -> torch.Tensor:
        """This layer's part of a whole-model decode step (`oasis_hf.DecodeGraph`), run eagerly or under its capture.

        Device work only, reading the step's first position from the cache's shared 0-d tensor (the Python around
        it runs once, at capture): the write-back to host, the decode step, and the selection job of an
        asynchronous selector forked onto the prefetch stream (the graph joins it before it ends, so the next step
        of this layer sees its table). Host bookkeeping (lengths, statistics) is `DecodeGraph`'s, per replay.
        """
        step = self.cache.step_runner
        start, end = step.start(self.device), step.end(self.device)
        num_tokens = query.shape[2]
        if self.device.type == "cuda":
            out = self.decode_step(query, key, value, start, scale, write_back=True, end=end)
        else:  # CPU (never captured): write the rows to host first, as an eager step does
            self.cache.host.write(self.layer_idx, key, value, int(start))
            out = self.decode_step(query, key, value, start, scale, write_back=False, end=end)
        if step.with_job:  # decided per forward by the runner (`job_due`), one captured graph each way
            stream = step.fork(self.device)
            if stream is not None:
                # `query` comes from the compute stream and dies there after this layer, while the job still reads
                # it on the prefetch stream: without this the next layers' allocations (in a capture, the graph's
                # pool) reuse its memory under the job, which then scores garbage and picks other blocks.
                query.record_stream(stream)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                _, delta = self.jobs.choose(query, start, num_tokens, scale)  # no remote tier on this path
            if delta is not None:
                gather = step.fork_gather(self.device)
                for tensor in delta if gather is not None else ():
                    tensor.record_stream(gather)  # made on the prefetch stream, read on the gather stream
                with torch.cuda.stream(gather) if gather is not None else contextlib.nullcontext():
                    self.jobs.fetch(delta)
        return out

    def decode_step(self, query, key, value, start: torch.Tensor, scale: float, write_back: bool,
                     end: torch.Tensor | None = None) -> torch.Tensor:
        """The device work of one decode / verification forward; `start` is a 0-d long tensor (tokens before it),
        `end` the same plus ``T`` (computed here when not given).

        Fixed shapes, no host synchronisation and no Python branch on data: every position-dependent quantity is
        derived from `start` on the device, so this function can be captured once in a CUDA graph and replayed at
        every later step of the same ``T``. On CUDA it is a handful of launches: the host write-back (forked), and
        for a synchronous selector but ``static`` (or an asynchronous one with `OasisConfig.sync_fetch_blocks`)
        `append_tokens` + `score_blocks` + `plan_blocks` + `gather_blocks`; then the sparse attention and its split
        merge, which appends the new tokens when no selection ran before it.
        """
        cfg = self.config
        if write_back:
            # New rows to the pinned host store on the write-back stream, forked here and joined at the end of the
            # step (inside a graph this is a parallel branch). No fetch of this step can read them: the blocks they
            # land in are the recent ones, always resident.
            compute = torch.cuda.current_stream(self.device)
            side = self.cache.runtime(self.device).writeback_stream
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                self.cache.host.write_at(self.layer_idx, key, value, start)
        kernels = use_triton(query, cfg.kernel_backend)
        latest = self.keeps_latest
        append = AppendState(self.table.slot_score, self.table.block_slot, self.summaries.data, self.summaries.kind,
                             cfg.sink_blocks, cfg.recent_blocks, self.summaries.codes, evict_oldest=latest)
        # Selection, delta, fetch in the step: synchronous selectors but `static` (whose set the append keeps), and
        # asynchronous ones with `sync_fetch_blocks` (they correct the previous step's job with this step's queries,
        # a few blocks at most). Those score the new tokens' blocks, so the append comes first; otherwise the
        # attention reads the new tokens from `key` / `value` and the append runs in its merge launch.
        asynchronous = self.cache.selector.asynchronous
        select = (not asynchronous and not latest) or (asynchronous and cfg.sync_fetch_blocks)
        if select:
            (append_tokens if kernels else append_tokens_ref)(
                key, value, start, self.pool_k, self.pool_v, self.table.slot_block, append.slot_score,
                append.block_slot, append.summaries, self.kv_start, kind=append.kind, sink_blocks=append.sink_blocks,
                recent_blocks=append.recent_blocks, codes=append.codes, evict_oldest=latest,
            )  # fmt: skip
            memory = "update" if not asynchronous else "read" if cfg.sync_fetch_memory else "off"
            scores = scoring.block_scores(self, query, scale, start, memory=memory)
            cap = cfg.sync_fetch_blocks if asynchronous else cfg.max_fetch_blocks
            blocks, slots, valid = scoring.plan(self, scores, cap, "corrected" if asynchronous else "fetched")
            self.cache.host.fetch(self.layer_idx, blocks, self.pool_k, self.pool_v, slots, valid, cfg.kernel_backend)
        if end is None:
            end = start + key.shape[2]
        attend = sparse_attention if kernels else sparse_attention_ref
        out = attend(query, self.pool_k, self.pool_v, self.table.slot_block, end, self.kv_start, scale, new_key=key,
                     new_value=value, append=None if select else append)
        if write_back:
            compute.wait_stream(side)  # join: later steps (and their fetches) are ordered after the write-back
        return out
