"""Prefill/decode disaggregation over a remote KV tier: `publish` on the prefill node, `attach` on the decode node.

The prefill node runs the model on the prompt with an ordinary `OasisCache`, then `publish` writes every layer's
blocks (one pool object per (request, layer, block)) and a small metadata object: the layout, the padding starts,
the block summaries, and the first selection (each layer's resident blocks and their slots). The decode node
`attach`-es a new `OasisCache` to the request by id: it pulls only the resident blocks into its GPU pool and keeps
the summaries on the GPU; afterwards the lookahead selection jobs pull each step's delta from the pool, in the
background, through a bounded host cache (`RemoteBlockStore`). Neither node copies the whole KV to the decode node.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from typing import Any

import torch

from oasis_hf.cache.layer import GRAPH_MAX_TOKENS
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.config import OasisConfig, blocks_for
from oasis_hf.errors import RemoteTierError, UnsupportedError
from oasis_hf.remote.mooncake import MooncakeTier
from oasis_hf.remote.store import RemoteBlockStore, block_key, meta_key, state_key
from oasis_hf.selectors import get_selector

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


@torch.inference_mode()
def publish(cache: OasisCache, tier: MooncakeTier, request: str, extra: dict[str, Any] | None = None) -> int:
    """Write the prefilled `cache` to the tier under `request`; returns the bytes written.

    `cache` must have run its prefill (and may have decoded since). `extra` is stored with the metadata and returned
    by `attach` (e.g. the first generated token). Blocks are hard-pinned in the pool, so a full pool fails the write
    instead of evicting another live request.
    """
    cache.wait()
    layers = cache.oasis_layers
    if not layers or not all(layer.is_initialized for layer in layers) or cache.host is None:
        raise UnsupportedError("publish needs a cache that has run its prefill (call the model on the prompt first)")
    if not cache.host.capturable_fetch:
        raise UnsupportedError("this cache is attached to a remote request already; publish from the prefill node")
    for layer in layers:
        if layer.device.type == "cuda":
            torch.cuda.synchronize(layer.device)  # the host write-back of every layer has landed
    host, cfg = cache.host, cache.config
    bs = cfg.block_size
    length = layers[0].length
    num_blocks = blocks_for(length, bs)
    written = 0
    for layer in layers:
        idx = layer.layer_idx
        # (NB, 2, B, H, BS, D): one contiguous object per block, K then V, every sequence and head.
        staging = torch.empty(num_blocks, 2, host.batch_size, host.num_kv_heads, bs, host.head_dim, dtype=host.dtype)
        for seg in host.segments:
            lo, hi = seg.start_block, min(seg.start_block + seg.num_blocks, num_blocks)
            if lo >= hi:
                continue
            staging[lo:hi, 0] = seg.keys[idx][:, :, : hi - lo].permute(2, 0, 1, 3, 4)
            staging[lo:hi, 1] = seg.values[idx][:, :, : hi - lo].permute(2, 0, 1, 3, 4)
        size = staging[0].numel() * staging.element_size()
        keys = [block_key(request, idx, blk) for blk in range(num_blocks)]
        tier.register(staging.data_ptr(), size * num_blocks)
        try:
            tier.put(keys, [staging[blk].data_ptr() for blk in range(num_blocks)], [size] * num_blocks,
                     overwrite=True)
        finally:
            tier.unregister(staging.data_ptr())
        written += size * num_blocks
        state = {
            "slot_block": layer.table.slot_block.cpu(),
            "slot_score": layer.table.slot_score.cpu(),
            "block_slot": layer.table.block_slot[..., :num_blocks].cpu(),
            "summaries": layer.summaries.data[..., :num_blocks, :].cpu(),
            "score_memory": layer.score_memory[..., :num_blocks].cpu(),  # (`score_decay`), so decoding continues alike
        }
        if layer.summaries.codes is not None:  # a 'quantized' summary's key codes
            state["codes"] = layer.summaries.codes[:, :, :num_blocks].cpu()
        written += _put_object(tier, state_key(request, idx), state)
    meta = {
        "version": FORMAT_VERSION,
        "config": cfg.to_dict(),
        "length": length,
        "kv_start": layers[0].kv_start.cpu(),
        "batch_size": host.batch_size,
        "num_kv_heads": host.num_kv_heads,
        "head_dim": host.head_dim,
        "dtype": str(host.dtype).removeprefix("torch."),
        "layers": [layer.layer_idx for layer in layers],
        "extra": extra or {},
    }
    written += _put_object(tier, meta_key(request), meta)  # last: its presence means the request is complete
    logger.info("published request %s: %d blocks x %d layers, %.1f MiB", request, num_blocks, len(layers),
                written / 2**20)
    return written


@torch.inference_mode()
def attach(model_config, tier: MooncakeTier, request: str, device: torch.device | str,
           hot_blocks: int | None = None, ahead_blocks: int = 4, free_on_close: bool = True,
           **overrides) -> tuple[OasisCache, dict]:
    """A decode-node `OasisCache` for a published `request`, with its resident blocks pulled to `device`.

    Parameters
    ----------
    model_config : the model's config (the same model as the prefill node).
    tier : a connected `MooncakeTier`.
    request : the id given to `publish`.
    device : where the model's layers run (one device).
    hot_blocks : host cache of pulled blocks, all layers together (default: two fetch caps per layer, and at least
        what one job can fetch); bounds the decode node's host memory with the tail ring.
    ahead_blocks : per layer and step, the best blocks just below the budget's cut that a background network thread
        pulls into the hot cache ahead of need (0: pull only what a job needs, when it needs it). On SmolLM2 at 2k
        tokens, 4 cut the pulls a job waits for by 56% for 1.5x the bytes (eval/results/remote_smollm2_2k).
    free_on_close : remove the request's objects from the pool when the cache is closed (request finished).
    overrides : `OasisConfig` fields to change from the published config (e.g. ``kernel_backend``, ``prefetch``);
        the layout fields (``block_size``, ``budget_tokens``, ``layer_budget_tokens``, ``sink_tokens``,
        ``recent_tokens``, ``summary``) must stay as published.

    Returns the cache and the `extra` dict given to `publish`. Decode with the model as usual
    (``model(next_token, past_key_values=cache)`` or ``generate``); close the cache when the request is done.
    """
    try:
        raw = tier.get_bytes(meta_key(request))
    except RemoteTierError as exc:
        raise RemoteTierError(f"request {request!r} is not in the remote tier (was it published?): {exc}") from exc
    meta = _load(raw)
    if meta.get("version") != FORMAT_VERSION:
        raise RemoteTierError(f"request {request!r} was published in format {meta.get('version')}, expected "
                              f"{FORMAT_VERSION}; publish it again with this oasis_hf version")
    layout = ("block_size", "budget_tokens", "layer_budget_tokens", "sink_tokens", "recent_tokens", "summary")
    published = OasisConfig.from_dict(meta["config"])
    config = dataclasses.replace(published, **overrides)
    fixed = [name for name in layout if getattr(config, name) != getattr(published, name)]
    if fixed:
        raise UnsupportedError(f"{fixed} must stay as published ({[getattr(published, n) for n in fixed]})")
    if not get_selector(config.selector).asynchronous:
        raise UnsupportedError(
            f"selector {config.selector!r} fetches inside the decode step, which cannot wait on the network; a "
            "remote-attached cache needs an asynchronous selector: attach(..., selector='lookahead')"
        )
    device = torch.device(device)
    cache = OasisCache(model_config, config)
    layer_ids = [layer.layer_idx for layer in cache.oasis_layers]
    if meta["layers"] != layer_ids:
        raise UnsupportedError(f"request {request!r} has layers {sorted(meta['layers'])}, the model {layer_ids}")
    bs, length = config.block_size, meta["length"]
    num_blocks = blocks_for(length, bs)
    max_fetch = config.max_fetch_blocks or max(layer.budget_blocks for layer in cache.oasis_layers)
    if hot_blocks is None:
        hot_blocks = max(2 * max_fetch * len(layer_ids), max_fetch * meta["batch_size"] * meta["num_kv_heads"])
    ring = config.recent_blocks + blocks_for(GRAPH_MAX_TOKENS, bs) + 2
    pin = config.pin_host_memory if config.pin_host_memory is not None else device.type == "cuda"
    dtype = getattr(torch, meta["dtype"])
    cache.host = RemoteBlockStore(
        tier, request, layer_ids, meta["batch_size"], meta["num_kv_heads"], meta["head_dim"], bs, dtype, pin=pin,
        ring_blocks=ring, hot_blocks=hot_blocks, capacity_blocks=num_blocks, pushed_blocks=length // bs,
        free_on_close=free_on_close, ahead_blocks=ahead_blocks,
    )  # fmt: skip
    try:
        size = 2 * cache.host.block_elems * cache.host.elem
        tail = torch.empty(2, meta["batch_size"], meta["num_kv_heads"], bs, meta["head_dim"], dtype=dtype)
        for layer in cache.oasis_layers:
            state = dict(_load(tier.get_bytes(state_key(request, layer.layer_idx))), batch_size=meta["batch_size"],
                         num_kv_heads=meta["num_kv_heads"], head_dim=meta["head_dim"], dtype=meta["dtype"],
                         kv_start=meta["kv_start"], length=length)  # fmt: skip
            layer.restore(state, device)
            resident = layer.table.slot_block[..., : layer.budget_blocks]
            slots = torch.arange(layer.budget_blocks, device=device).expand_as(resident)
            cache.host.fetch(layer.layer_idx, resident.clamp(min=0), layer.pool_k, layer.pool_v, slots, resident >= 0,
                             config.kernel_backend)
            if length % bs:  # the partial last block: its next rows arrive in the ring, its first ones from here
                tier.get([block_key(request, layer.layer_idx, num_blocks - 1)], [tail.data_ptr()], [size])
                cache.host.attach_tail(layer.layer_idx, num_blocks - 1, tail)
        for layer in cache.oasis_layers:
            if layer.device.type == "cuda":
                torch.cuda.synchronize(layer.device)
    except BaseException:
        cache.host.free_on_close = False  # a failed attach leaves the request for another try
        cache.close()
        raise
    return cache, meta["extra"]


def _put_object(tier: MooncakeTier, key: str, obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tier.put_bytes(key, buffer.getvalue())
    return buffer.tell()


def _load(raw: bytes):
    return torch.load(io.BytesIO(raw), weights_only=True)
