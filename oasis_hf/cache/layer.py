"""`OasisLayer`: one full-attention layer of an `OasisCache`.

``update`` (called by the attention module) appends the new K/V to the host store and returns the new tokens,
marked with a reference to this layer; the ``"oasis"`` attention function then calls `attend`, which does the
device-side work of the step:

- **prefill** (the first forward on an empty cache): dense attention over the chunk, block summaries of all of it,
  and the initial selection, copied into the pool straight from the chunk's K/V (no host read);
- **decode / verification** (``T`` new tokens on a non-empty cache): new blocks get slots (evicting the least
  important unpinned block), the new tokens go into the pool, the touched summaries are recomputed, the selector
  scores every block, the table plans the delta, the misses are fetched from host, and the sparse kernel attends
  over the resident blocks.

Per (sequence, KV head) the pool never holds more than ``S = budget_tokens // block_size`` blocks: the sinks (first
real blocks), the recent window (last blocks, new tokens included) and the selected blocks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from oasis_hf.cache.block_table import INF, BlockTable
from oasis_hf.cache.summaries import BlockSummaries
from oasis_hf.errors import DeviceMemoryError, UnsupportedError
from oasis_hf.kernels import sparse_attention, sparse_attention_ref, use_triton
from oasis_hf.kernels.dense import dense_attention

if TYPE_CHECKING:
    from oasis_hf.cache.oasis_cache import OasisCache

_HANDLE_ATTR = "_oasis_layer"


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
        self.cache = cache
        self.layer_idx = layer_idx
        self.config = cache.config
        self.length = 0
        self._pending: tuple[int, int] | None = None
        self.kv_start: torch.Tensor | None = None  # (B,) first real position (left padding)
        self.writeback_event = None
        self._ids: torch.Tensor | None = None  # (1, 1, NB_cap) arange, see _block_ids

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
        cfg = self.config
        start, end = self.length, self.length + key_states.shape[2]
        if start > 0:
            forced = cfg.sink_blocks + max(cfg.recent_blocks, -(-end // cfg.block_size) - start // cfg.block_size)
            if forced > cfg.budget_blocks:
                raise UnsupportedError(
                    f"a forward of {end - start} tokens on a non-empty OasisCache needs {forced} blocks resident, over "
                    f"the budget of {cfg.budget_blocks}; raise budget_tokens or feed fewer tokens per forward"
                )
        self.cache._reserve(end)
        self.cache._write_back(self, key_states, value_states, start)
        self.length = end
        self._pending = (start, end)
        handle = key_states.view(key_states.shape)  # a distinct tensor object over the same memory
        setattr(handle, _HANDLE_ATTR, self)
        return handle, value_states

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
        self.length = max(0, self.length + tokens_to_remove)
        self._pending = None
        if self.length == 0:
            self.reset()
            return
        self.table.drop_from(-(-self.length // self.config.block_size))

    def reset(self) -> None:
        self.length = 0
        self._pending = None
        self.kv_start = None
        if self.is_initialized:
            self.table.reset()
            self.summaries.data.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedError("OasisCache does not support beam search; use greedy or sampling (num_beams=1)")

    def grow(self, capacity_blocks: int) -> None:
        """Address `capacity_blocks` logical blocks (called when the host store grows)."""
        if self.is_initialized:
            self.table.grow(capacity_blocks)
            self.summaries.grow(capacity_blocks)

    @property
    def device_nbytes(self) -> int:
        """GPU bytes of this layer: pool + summaries + tables."""
        if not self.is_initialized:
            return 0
        tables = sum(t.numel() * t.element_size() for t in (self.table.slot_block, self.table.block_slot,
                                                             self.table.slot_score))
        return 2 * self.pool_k.numel() * self.pool_k.element_size() + self.summaries.nbytes + tables

    # ------------------------------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, scale: float
    ) -> torch.Tensor:
        """Attention of this forward's queries (B, H_q, T, D); returns (B, T, H_q, D)."""
        if self._pending is None:
            raise RuntimeError(f"OasisCache layer {self.layer_idx}: attention ran without a matching update")
        start, end = self._pending
        self._pending = None
        if start == 0:
            return self._prefill(query, key, value, attention_mask, scale, end)
        return self._decode(query, key, value, scale, start, end)

    def _prefill(self, query, key, value, attention_mask, scale, end) -> torch.Tensor:
        cfg = self.config
        out = dense_attention(query, key, value, attention_mask, scale)
        self.kv_start = _kv_start(attention_mask, self.batch_size, end, self.device)
        num_blocks = -(-end // cfg.block_size)
        pad = num_blocks * cfg.block_size - end
        blocks_k = torch.nn.functional.pad(key, (0, 0, 0, pad)).view(
            self.batch_size, self.num_kv_heads, num_blocks, cfg.block_size, self.head_dim
        )
        blocks_v = torch.nn.functional.pad(value, (0, 0, 0, pad)).view_as(blocks_k)
        self.summaries.write(0, blocks_k, self._token_ok(0, num_blocks, end))
        scores = self._scores(query[:, :, -1:], scale, end - 1, end)  # initial selection: the last query
        blocks, slots, valid = self.table.plan(scores, max_fetch=None)
        # The pool is empty, so every chosen block is a miss: copy them from the chunk, not from host.
        # `slots` is a permutation of the S slots, so scattering all S entries is safe; invalid ones stay unmapped.
        index = blocks.clamp(0, num_blocks - 1)[..., None, None].expand(-1, -1, -1, cfg.block_size, self.head_dim)
        slot_index = slots[..., None, None].expand_as(index)
        self.pool_k.scatter_(2, slot_index, blocks_k.gather(2, index))
        self.pool_v.scatter_(2, slot_index, blocks_v.gather(2, index))
        self.cache.stats.record_prefill(self.layer_idx, valid)
        return out

    def _decode(self, query, key, value, scale, start, end) -> torch.Tensor:
        cfg = self.config
        bs = cfg.block_size
        old_blocks, new_blocks = -(-start // bs), -(-end // bs)
        if new_blocks > old_blocks:
            fresh = torch.arange(old_blocks, new_blocks, device=self.device).expand(
                self.batch_size, self.num_kv_heads, -1
            )
            self.table.allocate(fresh, self._pinned_slots(new_blocks))
        # New tokens into their (resident) blocks.
        pos = torch.arange(start, end, device=self.device)
        slot = self.table.block_slot[:, :, pos // bs]  # (B, H_kv, T)
        b_idx = torch.arange(self.batch_size, device=self.device).view(-1, 1, 1)
        h_idx = torch.arange(self.num_kv_heads, device=self.device).view(1, -1, 1)
        self.pool_k[b_idx, h_idx, slot, pos % bs] = key
        self.pool_v[b_idx, h_idx, slot, pos % bs] = value
        # Summaries of the blocks the new tokens touched, recomputed from the pool.
        first = start // bs
        touched = self.table.block_slot[:, :, first:new_blocks]
        self.summaries.write(first, self.pool_k[b_idx, h_idx, touched], self._token_ok(first, new_blocks, end))
        # Selection, delta, fetch.
        scores = self._scores(query, scale, start, end)
        blocks, slots, valid = self.table.plan(scores, cfg.max_fetch_blocks)
        if self.writeback_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.writeback_event)  # host rows written
        self.cache.host.fetch(self.layer_idx, blocks, self.pool_k, self.pool_v, slots, valid, cfg.kernel_backend)
        self.cache.stats.record_step(self.layer_idx, valid)
        attend = sparse_attention if use_triton(query, cfg.kernel_backend) else sparse_attention_ref
        return attend(query, self.pool_k, self.pool_v, self.table.slot_block, end, self.kv_start, scale)

    # ------------------------------------------------------------------------------------------ helpers
    def _token_ok(self, first_block: int, end_block: int, end: int) -> torch.Tensor:
        """(B, 1, n, BS) bool: token holds a real, written token."""
        bs = self.config.block_size
        pos = torch.arange(first_block * bs, end_block * bs, device=self.device).view(1, 1, -1, bs)
        return (pos < end) & (pos >= self.kv_start.view(-1, 1, 1, 1))

    def _scores(self, query: torch.Tensor, scale: float, start: int, end: int) -> torch.Tensor:
        """(B, H_kv, NB_cap) scores with the shared rules: forced blocks +inf, non-blocks -inf."""
        cfg = self.config
        num_blocks = -(-end // cfg.block_size)
        ids = self._block_ids()
        first = (self.kv_start // cfg.block_size).view(-1, 1, 1)
        block_ok = (ids >= first) & (ids < num_blocks)
        raw = self.cache.selector.score(self, query, scale, block_ok)
        recent_from = min(num_blocks - cfg.recent_blocks, start // cfg.block_size)
        forced = block_ok & ((ids < first + cfg.sink_blocks) | (ids >= recent_from))
        return torch.where(forced, INF, torch.where(block_ok, raw.float(), -INF))

    def _block_ids(self) -> torch.Tensor:
        """(1, 1, NB_cap) arange, rebuilt only when the capacity grows."""
        cap = self.table.capacity_blocks
        if self._ids is None or self._ids.shape[-1] != cap:
            self._ids = torch.arange(cap, device=self.device).view(1, 1, -1)
        return self._ids

    def _pinned_slots(self, num_blocks: int) -> torch.Tensor:
        """(B, H_kv, S) bool: slots whose block is a sink or in the recent window for `num_blocks` blocks."""
        cfg = self.config
        resident = self.table.slot_block[..., : cfg.budget_blocks]
        first = (self.kv_start // cfg.block_size).view(-1, 1, 1)
        sink = (resident >= first) & (resident < first + cfg.sink_blocks)
        return (resident >= 0) & (sink | (resident >= num_blocks - cfg.recent_blocks))

    def exact_block_mass(self, query: torch.Tensor, scale: float, block_ok: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, NB_cap): exact softmax attention mass of `query` per block, from the full keys on host."""
        cfg = self.config
        if self.writeback_event is not None:
            self.writeback_event.synchronize()
        keys = self.cache.host.read_keys(self.layer_idx, self.length).to(self.device).float()
        batch, _, num_tokens, head_dim = query.shape
        q = query.float().reshape(batch, self.num_kv_heads, -1, head_dim)
        logits = torch.einsum("bhmd,bhnd->bhmn", q, keys) * scale
        key_pos = torch.arange(self.length, device=self.device)
        q_pos = self.length - num_tokens + torch.arange(num_tokens, device=self.device)
        q_pos = q_pos.repeat(q.shape[2] // num_tokens)  # rows ordered (g, t)
        allowed = (key_pos[None, :] <= q_pos[:, None])[None, None] & (key_pos >= self.kv_start.view(-1, 1, 1, 1))
        probs = torch.softmax(logits.masked_fill(~allowed, -INF), dim=-1).nan_to_num(0.0).sum(2)
        num_blocks = -(-self.length // cfg.block_size)
        probs = torch.nn.functional.pad(probs, (0, num_blocks * cfg.block_size - self.length))
        mass = probs.view(batch, self.num_kv_heads, num_blocks, cfg.block_size).sum(-1)
        return torch.nn.functional.pad(mass, (0, self.table.capacity_blocks - num_blocks))


def _kv_start(attention_mask, batch: int, length: int, device) -> torch.Tensor:
    """(B,) first real position from a 2-D left-padding mask (None: no padding)."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    if attention_mask.dim() != 2:
        raise UnsupportedError(
            f"OasisCache needs the 2-D padding mask of the 'oasis' mask function, got shape "
            f"{tuple(attention_mask.shape)}; call oasis_hf.register() before generating"
        )
    mask = attention_mask[:, -length:].to(device=device, dtype=torch.bool)
    first = mask.int().argmax(dim=-1)
    if not bool((mask.sum(-1) == length - first).all()):
        raise UnsupportedError(
            "OasisCache supports left padding only (real tokens contiguous at the end); set "
            "tokenizer.padding_side = 'left'"
        )
    return first.long()
