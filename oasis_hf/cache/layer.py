"""`OasisLayer`: one full-attention layer of an `OasisCache`.

``update`` (called by the attention module) appends the new K/V to the host store and returns the new tokens,
marked with a reference to this layer; the ``"oasis"`` attention function then calls `attend`, which does the
device-side work of the step:

- **prefill** (the first forward on an empty cache): dense attention over the chunk, block summaries of all of it,
  and the initial selection, copied into the pool straight from the chunk's K/V (no host read);
- **decode / verification** (``T`` new tokens on a non-empty cache): one `append_tokens` launch gives new blocks
  slots (evicting the least important unpinned block), writes the new tokens into the pool and recomputes the
  touched summaries; a synchronous selector then scores every block (`score_blocks`), the table plans the delta
  (`plan_blocks`) and the misses are fetched from host (`gather_blocks`); the sparse kernel attends over the
  resident blocks. An asynchronous selector runs score, plan and fetch after the step, for the next one.

Per (sequence, KV head) the pool never holds more than ``S = budget_tokens // block_size`` blocks: the sinks (first
real blocks), the recent window (last blocks, new tokens included) and the selected blocks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from oasis_hf.cache.block_table import INF, BlockTable
from oasis_hf.cache.pinned import capturing
from oasis_hf.cache.summaries import BlockSummaries
from oasis_hf.errors import DeviceMemoryError, OasisError, UnsupportedError
from oasis_hf.kernels import (
    INTERPRET,
    append_tokens,
    append_tokens_ref,
    score_blocks,
    score_blocks_ref,
    sparse_attention,
    sparse_attention_ref,
    use_triton,
)
from oasis_hf.kernels.dense import dense_attention

if TYPE_CHECKING:
    from oasis_hf.cache.oasis_cache import OasisCache

_HANDLE_ATTR = "_oasis_layer"

logger = logging.getLogger(__name__)

#: Decode / verification forwards of at most this many tokens are captured in CUDA graphs (one graph per ``T``).
GRAPH_MAX_TOKENS = 16


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
        self.length = 0
        self._pending: tuple[int, int] | None = None
        self._deferred_write = False  # this forward's host write-back runs inside the decode step
        self._ticket = None  # outstanding selection job (asynchronous selectors with prefetch on)
        self.kv_start: torch.Tensor | None = None  # (B,) first real position (left padding)
        self.writeback_event = None
        self._aranges: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, _StepGraph] = {}  # T -> captured decode step (CUDA)
        self._job_graphs: dict[int, _JobGraph] = {}  # T -> captured selection job (asynchronous selectors)
        self._job_warm: set[int] = set()
        self._eager_job: _EagerJob | None = None  # the latest eager selection job (see drop_rejected)
        self._staged: dict[str, torch.Tensor] | None = None  # the stale policy's proposal buffers
        self._stage_pending = False  # a proposal waits to be committed by the next step
        self._warm: set[int] = set()  # T values whose step already ran eagerly on the capture stream

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
        shape = (self.batch_size, self.num_kv_heads, cfg.budget_blocks, cfg.block_size, self.head_dim)
        try:
            self.pool_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.pool_v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except torch.OutOfMemoryError as exc:
            nbytes = 2 * math.prod(shape) * key_states.element_size()
            raise DeviceMemoryError(
                f"OasisCache layer {self.layer_idx}: the block pool needs {nbytes / 2**20:.1f} MiB on {self.device} "
                "and the allocation failed; lower OasisConfig.budget_tokens or the batch size"
            ) from exc
        capacity = max(cfg.budget_blocks, self.cache.host_capacity_blocks)
        self.table = BlockTable(self.batch_size, self.num_kv_heads, cfg.budget_blocks, capacity, self.device)
        self.summaries = BlockSummaries(
            cfg.summary, self.batch_size, self.num_kv_heads, capacity, self.head_dim, self.dtype, self.device
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
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_kv_heads:
            raise UnsupportedError(
                f"OasisCache layer {self.layer_idx} holds batch {self.batch_size} x {self.num_kv_heads} KV heads but "
                f"got {tuple(key_states.shape[:2])}; use a fresh OasisCache per batch (beam search and batch "
                "expansion are not supported)"
            )
        if self.cache._whole_step is not None:  # a whole-model decode step (`oasis_hf.DecodeGraph`): see `_graph_step`
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
            forced = cfg.sink_blocks + max(cfg.recent_blocks, -(-end // cfg.block_size) - start // cfg.block_size)
            chunk = forced > cfg.budget_blocks or end - start > cfg.dense_chunk_tokens
        self.cache._reserve(end)
        # A forward that will run as a captured graph writes its rows to host inside the graph; anything else
        # (prefill, CPU, eager steps) writes back here, on a side stream.
        self._deferred_write = start > 0 and not chunk and self._graphable(key_states)
        if not self._deferred_write:
            self.cache._write_back(self, key_states, value_states, start)
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
        self._await_job()  # the job rewrites the table that crop edits
        self._stage_pending = False  # a proposal may name blocks that no longer exist
        self.length = max(0, self.length + tokens_to_remove)
        if self.cache.host is not None:
            self.cache.host.truncate(self.layer_idx, self.length)
        self._pending = None
        if self.length == 0:
            self.reset()
            return
        self.table.drop_from(-(-self.length // self.config.block_size))

    def reset(self) -> None:
        if self._ticket is not None:
            self._await_job()
        self._graphs.clear()  # the next prefill sets a new kv_start tensor
        self._job_graphs.clear()
        self._warm.clear()  # and each T warms up eagerly again before its capture (see `grow`)
        self._job_warm.clear()
        self._stage_pending = False
        self.length = 0
        self._pending = None
        self.kv_start = None
        if self.is_initialized:
            self.table.reset()
            self.summaries.data.zero_()
            self.score_memory.zero_()

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
        if "score_memory" in state:  # publications before the selection memory have none: it starts empty
            self.score_memory[..., :capacity] = state["score_memory"].to(device)
        self.kv_start = state["kv_start"].to(device)
        self.length = state["length"]

    def grow(self, capacity_blocks: int) -> None:
        """Address `capacity_blocks` logical blocks (called when the host store grows)."""
        if self.is_initialized:
            self._graphs.clear()  # captured steps address the old tables and host segments
            self._job_graphs.clear()
            if self._stage_pending:  # commit it first: its scores and blocks address the old capacity
                self._await_job()  # the cache waited for every job before growing, so this does not block
                self._apply_staged()
            self._staged = None
            # The next step and job of each T run eagerly (allocating, and compiling the kernel variants of the new
            # table size: `plan_blocks` and `score_blocks` specialise on it) before they are captured again: a
            # compilation inside a capture invalidates it.
            self._warm.clear()
            self._job_warm.clear()
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
            return self._prefill(query, key, value, attention_mask, scale, end)
        if chunk:
            return self._prefill_chunk(query, key, value, attention_mask, scale, start, end)
        return self._decode(query, key, value, scale, start)

    def _prefill(self, query, key, value, attention_mask, scale, end) -> torch.Tensor:
        cfg = self.config
        self.kv_start, pads = self.cache.padding_starts(attention_mask, self.batch_size, end, self.device)
        out = dense_attention(query, key, value, attention_mask, scale, pad_lengths=pads)
        num_blocks = -(-end // cfg.block_size)
        pad = num_blocks * cfg.block_size - end
        blocks_k = torch.nn.functional.pad(key, (0, 0, 0, pad)).view(
            self.batch_size, self.num_kv_heads, num_blocks, cfg.block_size, self.head_dim
        )
        blocks_v = torch.nn.functional.pad(value, (0, 0, 0, pad)).view_as(blocks_k)
        block_ids = torch.arange(num_blocks, device=self.device)
        self.summaries.write(block_ids, blocks_k, self._token_ok(block_ids, end))
        scores = self._prefill_scores(query, key, scale, 0, end)
        blocks, slots, valid = self._plan(scores, max_fetch=None, count=False)
        # The pool is empty, so every chosen block is a miss: copy them from the chunk, not from host.
        # `slots` is a permutation of the S slots, so scattering all S entries is safe; invalid ones stay unmapped.
        index = blocks.clamp(0, num_blocks - 1)[..., None, None].expand(-1, -1, -1, cfg.block_size, self.head_dim)
        slot_index = slots[..., None, None].expand_as(index)
        self.pool_k.scatter_(2, slot_index, blocks_k.gather(2, index))
        self.pool_v.scatter_(2, slot_index, blocks_v.gather(2, index))
        self.cache.stats.record_prefill(self.layer_idx, valid)
        return out

    def _prefill_chunk(self, query, key, value, attention_mask, scale, start: int, end: int) -> torch.Tensor:
        """A long forward on a non-empty cache (chunked prefill): exact dense attention over this layer's whole
        sequence, the earlier part read back from host memory (one zero-copy gather on CUDA). GPU memory holds one
        layer's K/V at a time, not the model's. Then the summaries of the blocks it touched, and a new selection
        from its last query, with every resident slot refilled from the full K/V."""
        cfg = self.config
        bs = cfg.block_size
        self._await_job()
        if self.writeback_event is not None:  # every earlier row has landed in host memory
            torch.cuda.current_stream(self.device).wait_event(self.writeback_event)
            self.writeback_event = None
        past_k, past_v = self.cache.host.read_range(self.layer_idx, start, self.device)
        full_k, full_v = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
        del past_k, past_v
        out = dense_attention(query, full_k, full_v, attention_mask, scale)
        num_blocks = -(-end // bs)
        pad = num_blocks * bs - end
        blocks_k = torch.nn.functional.pad(full_k, (0, 0, 0, pad)).view(
            self.batch_size, self.num_kv_heads, num_blocks, bs, self.head_dim
        )
        blocks_v = torch.nn.functional.pad(full_v, (0, 0, 0, pad)).view_as(blocks_k)
        touched = torch.arange(start // bs, num_blocks, device=self.device)
        self.summaries.write(touched, blocks_k[:, :, start // bs :], self._token_ok(touched, end))
        # The selection memory starts afresh, as after one whole prefill: a chunked prefill then selects the same
        # blocks (given a last chunk of at least `prefill_window_tokens` tokens).
        self.score_memory.zero_()
        self._plan(self._prefill_scores(query, full_k, scale, start, end), max_fetch=None)
        resident = self.table.slot_block[..., : cfg.budget_blocks]
        index = resident.clamp(0, num_blocks - 1)[..., None, None].expand(-1, -1, -1, bs, self.head_dim)
        keep = (resident >= 0)[..., None, None]
        self.pool_k.copy_(torch.where(keep, blocks_k.gather(2, index), self.pool_k))
        self.pool_v.copy_(torch.where(keep, blocks_v.gather(2, index), self.pool_v))
        return out

    def _prefill_scores(self, query, keys, scale: float, start: int, end: int) -> torch.Tensor:
        """Scores of the first selection after a prefill forward holding positions ``start .. end - 1``.

        query : (B, H_q, end - start, D) the forward's queries; keys : (B, H_kv, end, D) every key so far, on the
        device. With `OasisConfig.prefill_window_tokens` ``W > 0`` (selectors that take it: not `static` or `oracle`)
        the exact attention mass of the last ``W`` queries, else the last query against the summaries.
        """
        last = torch.full((), end - 1, dtype=torch.long, device=self.device)
        window = min(self.config.prefill_window_tokens, query.shape[2])
        if window == 0 or not self.cache.selector.window_and_memory:
            return self._scores(query[:, :, -1:], scale, last)
        q = query[:, :, -window:]
        q_pos = torch.arange(end - window, end, device=self.device)
        mass = torch.zeros(self.batch_size, self.num_kv_heads, self.table.capacity_blocks, device=self.device)
        group = q.shape[1] // self.num_kv_heads
        # One (sequence, KV head) at a time: (G * W, end) float32 logits, 64 MiB for G = 4, W = 32 at 128k tokens.
        for b in range(self.batch_size):
            for h in range(self.num_kv_heads):
                mass[b : b + 1, h : h + 1] = block_mass(
                    q[b : b + 1, h * group : (h + 1) * group], keys[b : b + 1, h : h + 1], scale, q_pos,
                    self.kv_start[b : b + 1], self.config.block_size, self.table.capacity_blocks,
                )
        return self._scores(q, scale, last, num_tokens=1, raw=mass)

    def _decode(self, query, key, value, scale, start) -> torch.Tensor:
        self.cache.stats.decode_layer_steps += 1
        if self.config.prefetch_policy == "stale" and self.cache.selector.asynchronous:
            self._commit_staged()  # the previous step's proposal, if its job is done; never waits
        else:
            self._await_job()  # the previous step's selection job rewrote this layer's table and pool
        if self.writeback_event is not None:  # host rows written on the side stream before any block is read back
            torch.cuda.current_stream(self.device).wait_event(self.writeback_event)
            self.writeback_event = None  # later work on this stream stays ordered after the wait
        if self._deferred_write:
            out, query_src, start_src, graphed = self._run_graph(query, key, value, scale, start)
        else:
            start_src = torch.full((), start, dtype=torch.long, device=self.device)
            query_src, graphed = query, False
            out = self._decode_step(query, key, value, start_src, scale, write_back=False)
        if self.config.measure_recall:
            self._measure_recall(query, scale)
        if self.cache.selector.asynchronous:
            self._submit_job(query_src, start_src, query.shape[2], scale, graphed)
        return out

    def _graph_step(self, query, key, value, scale: float) -> torch.Tensor:
        """This layer's part of a whole-model decode step (`oasis_hf.DecodeGraph`), run eagerly or under its capture.

        Device work only, reading the step's first position from the cache's shared 0-d tensor (the Python around
        it runs once, at capture): the write-back to host, the decode step, and the selection job of an
        asynchronous selector forked onto the prefetch stream (the graph joins it before it ends, so the next step
        of this layer sees its table). Host bookkeeping (lengths, statistics) is `DecodeGraph`'s, per replay.
        """
        step = self.cache._whole_step
        start, end = step.start(self.device), step.end(self.device)
        num_tokens = query.shape[2]
        if self.device.type == "cuda":
            out = self._decode_step(query, key, value, start, scale, write_back=True, end=end)
        else:  # CPU (never captured): write the rows to host first, as an eager step does
            self.cache.host.write(self.layer_idx, key, value, int(start))
            out = self._decode_step(query, key, value, start, scale, write_back=False, end=end)
        if self.cache.selector.asynchronous:
            stream = step.fork(self.device)
            if stream is not None:
                # `query` comes from the compute stream and dies there after this layer, while the job still reads
                # it on the prefetch stream: without this the next layers' allocations (in a capture, the graph's
                # pool) reuse its memory under the job, which then scores garbage and picks other blocks.
                query.record_stream(stream)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._job(query, start, num_tokens, scale)
        return out

    def _measure_recall(self, query: torch.Tensor, scale: float) -> None:
        """Exact attention of this step against what was resident when it ran (synchronises; evaluation only)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the graph's host write-back has landed
        mass = self.exact_block_mass(query, scale)  # (B, H_kv, NB_cap), rows summed
        num_slots = self.config.budget_blocks
        resident = self.table.slot_block[..., :num_slots]
        held = torch.where(resident >= 0, mass.gather(-1, resident.clamp(min=0)), 0.0)
        mass_recall = (held.sum(-1) / mass.sum(-1).clamp_min(1e-30)).mean()
        top_mass, top = mass.topk(min(num_slots, mass.shape[-1]), dim=-1)
        wanted = top_mass > 0
        hit = (top[..., :, None] == resident[..., None, :]).any(-1) & wanted
        topk_recall = (hit.sum(-1) / wanted.sum(-1).clamp_min(1)).float().mean()
        stats = self.cache.stats
        stats.recall_steps += 1
        stats.mass_recall_sum += float(mass_recall)
        stats.topk_recall_sum += float(topk_recall)

    # ------------------------------------------------------------------------------------------ selection jobs
    def _job(self, query: torch.Tensor, start: torch.Tensor, num_tokens: int, scale: float) -> None:
        """Choose and fetch the blocks of this layer's next step from this step's lookahead queries.

        query : (B, H_q, T, D) this forward's queries; start : 0-d long tensor, the forward's first position.
        Runs on the prefetch worker (its stream) or inline; fixed shapes, no host synchronisation.
        """
        cfg = self.config
        rows = self.cache.selector.lookahead_queries(query)
        # The next step's view: everything up to this forward's last token, ``start + num_tokens - 1``.
        scores = self._scores(rows, scale, start, num_tokens=1, start_offset=num_tokens - 1)
        if cfg.prefetch_policy == "stale":
            self._stage(scores)
        else:
            blocks, slots, valid = self._plan(scores, cfg.max_fetch_blocks)
            self.cache.host.fetch(self.layer_idx, blocks, self.pool_k, self.pool_v, slots, valid, cfg.kernel_backend,
                                  self._job_programs())
        self.cache.host.prefetch_hint(self.layer_idx, scores, self.table.num_slots)  # remote tier: pull ahead

    def _stage(self, scores: torch.Tensor) -> None:
        """The ``stale`` policy's job: propose the delta without touching the table, and gather the proposed blocks
        into staging buffers; the layer's next step commits it if the job has finished by then (`_commit_staged`).
        Writes only buffers the step never reads, so the step may run concurrently with it."""
        cfg = self.config
        blocks, slots, valid, block_scores = self.table.propose(scores, cfg.max_fetch_blocks)
        width = self._stage_width()
        st = self._staged
        if st is None or st["scores"].shape != scores.shape:
            shape = (self.batch_size, self.num_kv_heads, width)
            pool = (*shape, cfg.block_size, self.head_dim)
            st = self._staged = {
                "blocks": torch.zeros(shape, dtype=torch.long, device=self.device),
                "slots": torch.zeros(shape, dtype=torch.long, device=self.device),
                "valid": torch.zeros(shape, dtype=torch.bool, device=self.device),
                "expected": torch.zeros(shape, dtype=torch.long, device=self.device),
                "block_scores": torch.zeros(shape, dtype=torch.float32, device=self.device),
                "scores": torch.zeros_like(scores, dtype=torch.float32),
                "k": torch.zeros(pool, dtype=self.dtype, device=self.device),
                "v": torch.zeros(pool, dtype=self.dtype, device=self.device),
            }
        st["blocks"].copy_(blocks[..., :width])
        st["slots"].copy_(slots[..., :width])
        st["valid"].copy_(valid[..., :width])
        st["expected"].copy_(self.table.slot_block.gather(-1, slots[..., :width]))
        st["block_scores"].copy_(block_scores[..., :width])
        st["scores"].copy_(scores)
        entries = self._arange(width).expand(self.batch_size, self.num_kv_heads, -1)
        self.cache.host.fetch(self.layer_idx, st["blocks"], st["k"], st["v"], entries, st["valid"],
                              cfg.kernel_backend, self._job_programs())

    def _job_programs(self) -> int | None:
        """Program cap of this layer's job gather: `fetch_programs` when the job runs beside the step (prefetch on),
        none when it runs inline on the compute stream (nothing to share the GPU with)."""
        return self.config.fetch_programs if self.config.prefetch else None

    def _stage_width(self) -> int:
        """Proposal entries kept: the fetch cap plus the blocks that are always resident (their misses are forced)."""
        cfg = self.config
        if cfg.max_fetch_blocks is None:
            return cfg.budget_blocks
        return min(cfg.budget_blocks, cfg.max_fetch_blocks + cfg.sink_blocks + cfg.recent_blocks)

    def _commit_staged(self) -> None:
        """The ``stale`` policy at the start of a step: commit the last job's proposal if it has finished (its
        entries revalidated against the table as it is now), else run on the blocks already resident and count a
        stale step. Never waits for the worker."""
        if not self._stage_pending:
            return
        ticket = self._ticket
        if ticket is not None:
            finished = ticket.done.is_set() and (ticket.finished is None or ticket.finished.query())
            if not finished:
                self.cache.stats.prefetch_late += 1
                self.cache.stats.stale_steps += 1
                return  # the next job replaces the proposal; the worker runs jobs in order
            self._await_job()  # does not wait: orders this stream after the job's work
        self._apply_staged()

    def _apply_staged(self) -> None:
        """Commit the finished proposal: revalidate its entries, install them, copy their blocks into the pool."""
        self._stage_pending = False
        st = self._staged
        applied = self.table.commit(st["blocks"], st["slots"], st["valid"], st["expected"], st["block_scores"],
                                    st["scores"])
        index = st["slots"][..., None, None].expand(-1, -1, -1, self.config.block_size, self.head_dim)
        keep = applied[..., None, None]
        self.pool_k.scatter_(2, index, torch.where(keep, st["k"], self.pool_k.gather(2, index)))
        self.pool_v.scatter_(2, index, torch.where(keep, st["v"], self.pool_v.gather(2, index)))
        self.cache.stats.record_fetched(applied)

    def _submit_job(self, query, start, num_tokens: int, scale: float, graphed: bool) -> None:
        """Run (prefetch off) or queue (prefetch on) this step's selection job. `graphed`: the step was a graph
        replay, so `query`/`start` are its static buffers and the job can be a captured graph as well."""
        self.cache.stats.prefetch_jobs += 1
        self._stage_pending = self.config.prefetch_policy == "stale"
        self.cache.host.note_step(self.layer_idx, self.length)
        run = self._job_runner(query, start, num_tokens, scale, graphed and self.cache.host.capturable_fetch)
        if not self.config.prefetch:
            run()
            return
        if INTERPRET and self.device.type == "cpu" and self.config.kernel_backend == "triton":
            raise UnsupportedError(
                "kernel_backend='triton' on CPU tensors runs Triton's interpreter, which cannot run kernels from two "
                "threads at once (the prefetch worker and the decode step); set OasisConfig.prefetch=False (jobs "
                "inline) or kernel_backend='auto'"
            )
        prefetcher = self.cache._prefetcher(self.device)
        if prefetcher.stream is not None:  # the worker stream reads these after the caller may free them
            query.record_stream(prefetcher.stream)
            start.record_stream(prefetcher.stream)
        if isinstance(run, _EagerJob) or self.config.prefetch_launch != "caller":
            self._ticket = prefetcher.submit(run)
        else:  # a graph replay: launched onto the prefetch stream from here, no thread hand-off
            self._ticket = prefetcher.launch(run)

    def _job_runner(self, query, start, num_tokens: int, scale: float, graphed: bool):
        """A callable doing the job: eager, or the replay of the job captured for this ``T`` (first graphed job of
        a ``T`` eager, the second captures; a replay is one launch instead of the job's four and its Python)."""
        if not graphed:
            job = self._eager_job = _EagerJob(self, query, start, num_tokens, scale)
            return job
        graph = self._job_graphs.get(num_tokens)
        if graph is None or graph.scale != scale:
            if num_tokens not in self._job_warm:
                # The warm-up runs exactly what the capture will (all T queries: not narrowable by drop_rejected),
                # so every Triton specialisation is compiled before it; a compile inside a capture invalidates it.
                self._job_warm.add(num_tokens)
                return _EagerJob(self, query, start, num_tokens, scale)
            self.cache.wait()  # nothing in flight on the worker while capturing
            graph = self._job_graphs[num_tokens] = _JobGraph(self, query, start, num_tokens, scale)
        return graph.graph.replay

    def drop_rejected(self, tokens: int) -> None:
        """The last `tokens` of the latest forward were rejected drafts: if that forward's selection job has not
        started yet, it scores with the accepted queries only (a job already running or captured as a graph keeps
        all of them; either way the output is exact, only the choice of blocks changes)."""
        job, self._eager_job = self._eager_job, None
        if job is not None and job.narrow(tokens):
            self.cache.stats.narrowed_jobs += 1

    def _await_job(self) -> None:
        """Wait (host, then stream) for this layer's outstanding selection job; count it late if unfinished."""
        if self._ticket is None:
            return
        ticket, self._ticket = self._ticket, None
        prefetcher = self.cache._prefetcher(self.device)
        late, stall = prefetcher.late, prefetcher.stall_s
        prefetcher.wait(ticket)
        stats = self.cache.stats
        stats.prefetch_late += prefetcher.late - late
        stats.prefetch_stall_s += prefetcher.stall_s - stall
        stats.prefetch_queue_wait_s += ticket.queue_wait_s
        stats.prefetch_job_host_s += ticket.run_s

    def _decode_step(self, query, key, value, start: torch.Tensor, scale: float, write_back: bool,
                     end: torch.Tensor | None = None) -> torch.Tensor:
        """The device work of one decode / verification forward; `start` is a 0-d long tensor (tokens before it),
        `end` the same plus ``T`` (computed here when not given).

        Fixed shapes, no host synchronisation and no Python branch on data: every position-dependent quantity is
        derived from `start` on the device, so this function can be captured once in a CUDA graph and replayed at
        every later step of the same ``T``. On CUDA it is a handful of launches: the host write-back (forked),
        `append_tokens`, for a synchronous selector `score_blocks` + `plan_blocks` + `gather_blocks`, and the sparse
        attention with its split merge.
        """
        cfg = self.config
        if write_back:
            # New rows to the pinned host store on the write-back stream, forked here and joined at the end of the
            # step (inside a graph this is a parallel branch). No fetch of this step can read them: the blocks they
            # land in are the recent ones, always resident.
            compute = torch.cuda.current_stream(self.device)
            side = self.cache._writeback_stream(self.device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                self.cache.host.write_at(self.layer_idx, key, value, start)
        kernels = use_triton(query, cfg.kernel_backend)
        (append_tokens if kernels else append_tokens_ref)(
            key, value, start, self.pool_k, self.pool_v, self.table.slot_block, self.table.slot_score,
            self.table.block_slot, self.summaries.data, self.kv_start, kind=self.summaries.kind,
            sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks,
        )  # fmt: skip
        # Selection, delta, fetch (synchronous selectors; asynchronous ones did it after the previous step).
        if not self.cache.selector.asynchronous:
            scores = self._scores(query, scale, start)
            blocks, slots, valid = self._plan(scores, cfg.max_fetch_blocks)
            self.cache.host.fetch(self.layer_idx, blocks, self.pool_k, self.pool_v, slots, valid, cfg.kernel_backend)
        if end is None:
            end = start + key.shape[2]
        attend = sparse_attention if kernels else sparse_attention_ref
        out = attend(query, self.pool_k, self.pool_v, self.table.slot_block, end, self.kv_start, scale)
        if write_back:
            compute.wait_stream(side)  # join: later steps (and their fetches) are ordered after the write-back
        return out

    # ------------------------------------------------------------------------------------------ CUDA graphs
    def _graphable(self, states: torch.Tensor) -> bool:
        """Whether a forward of `states` (B, H, T, D) runs as a captured CUDA graph."""
        return (
            states.is_cuda
            and self.config.cuda_graphs
            and self.cache.selector.capturable
            and self.cache.host.pin
            and states.shape[2] <= GRAPH_MAX_TOKENS
            and not torch.cuda.is_current_stream_capturing()
        )

    def _run_graph(self, query, key, value, scale, start):
        """Replay the captured step for this ``T``; the first step of a ``T`` runs eagerly (warm-up), the second
        captures. Returns the output and the query and start tensors the step read (for the selection job)."""
        num_tokens = query.shape[2]
        graph = self._graphs.get(num_tokens)
        if graph is None or graph.scale != scale:
            stream = self.cache._capture_stream(self.device)
            if num_tokens not in self._warm:
                # Eager warm-up on the capture stream: compiles the Triton kernels and creates the library handles
                # and workspaces that stream needs, so nothing is created during capture.
                self._warm.add(num_tokens)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    start_t = torch.full((), start, dtype=torch.long, device=self.device)
                    out = self._decode_step(query, key, value, start_t, scale, write_back=True)
                compute = torch.cuda.current_stream(self.device)
                compute.wait_stream(stream)
                for tensor in (out, query, start_t):
                    tensor.record_stream(compute)
                return out, query, start_t, False
            self.cache.wait()  # no selection job in flight while capturing (its stream must not touch our state)
            graph = self._graphs[num_tokens] = _StepGraph(self, query, key, value, scale, stream)
            self._job_graphs.pop(num_tokens, None)  # a job graph reads the old step graph's buffers
        self.cache.stats.graph_replays += 1
        return graph.run(query, key, value, start), graph.query, graph.start, True

    # ------------------------------------------------------------------------------------------ helpers
    def _arange(self, n: int) -> torch.Tensor:
        """(n,) long arange on the layer's device, memoised."""
        ids = self._aranges.get(n)
        if ids is None:
            ids = self._aranges[n] = torch.arange(n, device=self.device)
        return ids

    def _token_ok(self, block_ids: torch.Tensor, end) -> torch.Tensor:
        """(B, 1, n, BS) bool for blocks `block_ids` (n,): the token is real (not padding) and written (< end)."""
        bs = self.config.block_size
        pos = (block_ids[:, None] * bs + self._arange(bs)).view(1, 1, -1, bs)
        return (pos < end) & (pos >= self.kv_start.view(-1, 1, 1, 1))

    def _scores(self, query: torch.Tensor, scale: float, start: torch.Tensor, num_tokens: int | None = None,
                raw: torch.Tensor | None = None, start_offset: int = 0):
        """(B, H_kv, NB_cap) scores with the shared rules (`score_blocks`): forced blocks +inf, non-blocks -inf.

        The view holds positions up to ``start + start_offset + num_tokens - 1`` (`start`: 0-d long tensor;
        `num_tokens` defaults to the T of `query` (B, H_q, T, D), whose rows score the blocks). `raw` (B, H_kv,
        NB_cap): scores of those rows computed elsewhere (the prefill window) instead of the selector's. With
        `OasisConfig.score_decay` the scores of a selector that takes it (not `static` or `oracle`) are merged into
        the layer's selection memory.
        """
        cfg = self.config
        selector = self.cache.selector
        if raw is None and selector.scoring == "custom":
            raw = selector.score(self, query, scale)
        score = score_blocks if use_triton(query, cfg.kernel_backend) else score_blocks_ref
        return score(
            query, self.summaries.data, raw, self.score_memory, self.kv_start, start, scale,
            kind=self.summaries.kind, source="raw" if raw is not None else selector.scoring,
            num_tokens=query.shape[2] if num_tokens is None else num_tokens, block_size=cfg.block_size,
            sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks,
            decay=cfg.score_decay if selector.window_and_memory else 0.0, start_offset=start_offset,
        )  # fmt: skip

    def _plan(self, scores: torch.Tensor, max_fetch: int | None, count: bool = True):
        """`BlockTable.plan` with this layer's kernel backend; `count`: add the fetched blocks to the stats."""
        fetched = self.cache.stats.counters(self.device)[1:2] if count else None
        return self.table.plan(scores, max_fetch, self.config.kernel_backend, fetched)

    def exact_block_mass(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """(B, H_kv, NB_cap): exact softmax attention mass of `query` per block, from the full keys on host."""
        if self.writeback_event is not None:
            self.writeback_event.synchronize()
        keys = self.cache.host.read_keys(self.layer_idx, self.length).to(self.device)
        num_tokens = query.shape[2]
        q_pos = self.length - num_tokens + torch.arange(num_tokens, device=self.device)
        return block_mass(query, keys, scale, q_pos, self.kv_start, self.config.block_size,
                          self.table.capacity_blocks)


def block_mass(query: torch.Tensor, keys: torch.Tensor, scale: float, q_pos: torch.Tensor, kv_start: torch.Tensor,
               block_size: int, capacity_blocks: int) -> torch.Tensor:
    """Exact causal softmax attention mass per block, summed over a GQA group's query rows.

    query : (B, H_q, T, D) at positions `q_pos` (T,); keys : (B, H_kv, N, D) positions ``0 .. N-1``; kv_start : (B,)
    first real key (left padding). Returns (B, H_kv, capacity_blocks) float32, zero past the last block.
    """
    batch, _, num_tokens, head_dim = query.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    q = query.float().reshape(batch, num_kv_heads, -1, head_dim)  # rows ordered (g, t)
    logits = torch.einsum("bhmd,bhnd->bhmn", q, keys.float()) * scale
    key_pos = torch.arange(length, device=keys.device)
    rows_pos = q_pos.repeat(q.shape[2] // num_tokens)
    allowed = (key_pos[None, :] <= rows_pos[:, None])[None, None] & (key_pos >= kv_start.view(-1, 1, 1, 1))
    probs = torch.softmax(logits.masked_fill(~allowed, -INF), dim=-1).nan_to_num(0.0).sum(2)
    num_blocks = -(-length // block_size)
    probs = torch.nn.functional.pad(probs, (0, num_blocks * block_size - length))
    mass = probs.view(batch, num_kv_heads, num_blocks, block_size).sum(-1)
    return torch.nn.functional.pad(mass, (0, capacity_blocks - num_blocks))


def padding_starts(attention_mask, batch: int, length: int, device) -> tuple[torch.Tensor, list[int]]:
    """The first real position of each sequence from a 2-D left-padding mask (None: no padding), as a (B,) long
    tensor on `device` and as a host list (the number of padding tokens per sequence), read in one synchronisation."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device), [0] * batch
    if attention_mask.dim() != 2:
        raise UnsupportedError(
            f"OasisCache needs the 2-D padding mask of the 'oasis' mask function, got shape "
            f"{tuple(attention_mask.shape)}; call oasis_hf.register() before generating"
        )
    mask = attention_mask[:, -length:].to(device=device, dtype=torch.bool)
    first = mask.int().argmax(dim=-1)
    left = mask.sum(-1) == length - first
    pads, ok = torch.stack([first, left.long()]).tolist()
    if not all(ok):
        raise UnsupportedError(
            "OasisCache supports left padding only (real tokens contiguous at the end); set "
            "tokenizer.padding_side = 'left'"
        )
    return first.long(), pads


def _capture(layer: OasisLayer, kind: str, stream: torch.cuda.Stream, fn):
    """Capture `fn()` on `stream` into a new CUDA graph in the cache's `kind` pool; returns (graph, fn's result).

    ``thread_local``: the prefetch worker may call the CUDA API (allocations) on its own stream meanwhile;
    `capturing` (entered before ``capture_begin``): a collected cache's host buffers are unregistered, and its
    graphs destroyed, after the capture, not inside it."""
    device = layer.device
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), capturing():
        graph.capture_begin(pool=layer.cache._graph_pool(device, kind), capture_error_mode="thread_local")
        try:
            result = fn()
        except BaseException:
            # A failed capture makes capture_end raise "operation failed due to a previous error during
            # capture", which would hide the error that broke it: end it quietly and raise the real one.
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture is invalid either way
                logger.debug("capture_end after a failed %s capture", kind, exc_info=True)
            raise
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, result


class _StepGraph:
    """`OasisLayer._decode_step` for one ``T``, captured in a CUDA graph with static inputs.

    Replaying costs a handful of launches (input copies, the start position, the replay, the output copy) instead of
    the step's own launches and Python, which with the model's eager modules make a decode step host-bound (the
    whole-model graph, `oasis_hf.DecodeGraph`, removes the rest). Everything the
    step reads or writes in place (pool, table, summaries, host store, counters) is a persistent tensor of the
    layer; the graph is dropped whenever one of them is reallocated (`OasisLayer.grow`, `OasisLayer.reset`).
    """

    def __init__(self, layer: OasisLayer, query, key, value, scale: float, stream: torch.cuda.Stream) -> None:
        device = self.device = layer.device
        self.scale = scale
        self.query = torch.empty_like(query, memory_format=torch.contiguous_format)
        self.key = torch.empty_like(key, memory_format=torch.contiguous_format)
        self.value = torch.empty_like(value, memory_format=torch.contiguous_format)
        self.start = torch.zeros((), dtype=torch.long, device=device)
        self.graph, self.out = _capture(
            layer, "step", stream,
            lambda: layer._decode_step(self.query, self.key, self.value, self.start, scale, write_back=True),
        )  # fmt: skip

    def run(self, query, key, value, start: int) -> torch.Tensor:
        """Replay on the current stream: (B, H_q, T, D) query -> (B, T, H_q, D), a fresh tensor."""
        self.query.copy_(query)
        self.key.copy_(key)
        self.value.copy_(value)
        self.start.fill_(start)  # a fill kernel with the value as argument: no host buffer to race with
        self.graph.replay()
        return self.out.clone()


class _JobGraph:
    """`OasisLayer._job` for one ``T``, captured reading the step graph's static query and start buffers.

    Replayed on the prefetch worker's stream (or inline). It has its own memory pool, shared with the other layers'
    job graphs only: jobs run one after another on the worker stream but concurrently with the step graphs.
    """

    def __init__(self, layer: OasisLayer, query, start, num_tokens: int, scale: float) -> None:
        device = self.device = layer.device
        self.scale = scale
        self.graph, _ = _capture(layer, "job", layer.cache._capture_stream(device, background=True),
                                 lambda: layer._job(query, start, num_tokens, scale))


class _EagerJob:
    """An eager selection job whose query count can still shrink until the worker starts it (`narrow`)."""

    def __init__(self, layer: OasisLayer, query, start, num_tokens: int, scale: float) -> None:
        self.layer, self.query, self.start, self.scale = layer, query, start, scale
        self.keep = num_tokens
        self._lock = threading.Lock()
        self._started = False

    def narrow(self, rejected: int) -> bool:
        """Drop the last `rejected` queries if the job has not started; returns whether it did."""
        with self._lock:
            if self._started or rejected <= 0:
                return False
            self.keep = max(1, self.keep - rejected)
            return True

    def __call__(self) -> None:
        with self._lock:
            self._started = True
            keep = self.keep
        query = self.query if keep == self.query.shape[2] else self.query[:, :, :keep]
        self.layer._job(query, self.start, keep, self.scale)
        self.layer = self.query = self.start = None  # the ticket may outlive the step: drop the references
