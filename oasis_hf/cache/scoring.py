"""Block scores and the planned delta of one layer: the leaves a decode step, a selection job and a prefill call.

- `block_scores`: every block's score with the shared rules (`score_blocks`: forced blocks +inf, non-blocks -inf,
  the selection memory merged in) from the selector's rows, or from raw scores computed elsewhere;
- `plan`: the table's plan of the capped delta (`plan_blocks`), counted in the statistics;
- `block_mass` / `exact_block_mass`: exact softmax attention mass per block (the oracle, the prefill window, recall);
- `measure_recall`: what share of that mass the resident blocks held (evaluation only: it synchronises).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasis_hf.kernels import block_mass as kernel_block_mass
from oasis_hf.kernels import block_mass_ref, score_blocks, score_blocks_ref, use_triton
from oasis_hf.selectors.base import ScoringContext

if TYPE_CHECKING:
    from oasis_hf.cache.layer import OasisLayer


def block_scores(layer: OasisLayer, query: torch.Tensor, scale: float, start: torch.Tensor,
                 num_tokens: int | None = None, raw: torch.Tensor | None = None,
                 start_offset: int = 0, memory: str = "update") -> torch.Tensor:
    """(B, H_kv, NB_cap) scores of `layer`'s blocks.

    The view holds positions up to ``start + start_offset + num_tokens - 1`` (`start`: 0-d long tensor;
    `num_tokens` defaults to the T of `query` (B, H_q, T, D), whose rows score the blocks). `raw` (B, H_kv,
    NB_cap): scores of those rows computed elsewhere (the prefill window) instead of the selector's. With
    `OasisConfig.score_decay` the scores of a selector that takes it (not `static` or `oracle`) are merged into
    the layer's selection memory (``memory="update"``); ``"read"`` merges it without updating it, ``"off"``
    neither reads nor updates it (`OasisConfig.sync_fetch_blocks`' in-step correction: ``"read"`` with
    `OasisConfig.sync_fetch_memory`, else ``"off"``: the step's own queries alone).
    """
    if memory not in ("update", "read", "off"):
        raise ValueError(f"block_scores: memory={memory!r}; choose 'update', 'read' or 'off'")
    cfg = layer.config
    selector = layer.cache.selector
    if raw is None and selector.scoring == "custom":
        context = ScoringContext(layer.summaries.data, cfg.kernel_backend, layer.exact_block_mass,
                                 layer.summaries.kind, layer.summaries.codes)
        raw = selector.score(context, query, scale)
    score = score_blocks if use_triton(query, cfg.kernel_backend) else score_blocks_ref
    num_tokens = query.shape[2] if num_tokens is None else num_tokens
    return score(
        query, layer.summaries.data, raw, layer.score_memory, layer.kv_start, start, scale,
        kind=layer.summaries.kind, source="raw" if raw is not None else selector.scoring,
        num_tokens=num_tokens, block_size=cfg.block_size,
        sink_blocks=cfg.sink_blocks, recent_blocks=cfg.recent_blocks,
        decay=cfg.score_decay if selector.window_and_memory and memory != "off" else 0.0, start_offset=start_offset,
        memory_write=memory == "update", codes=layer.summaries.codes,
        candidates=cfg.score_candidates(layer.layer_idx, num_tokens) if raw is None else 0,
    )  # fmt: skip


def plan(layer: OasisLayer, scores: torch.Tensor, max_fetch: int | None, counter: str | None = "fetched"):
    """`BlockTable.plan` of `layer`'s table with its kernel backend: ``(blocks, slots, valid)``; the fetched blocks
    are added to the statistics' `counter` (``"corrected"``: an asynchronous selector's in-step correction; None:
    not counted)."""
    fetched = layer.cache.stats.counter(layer.device, counter) if counter is not None else None
    return layer.table.plan(scores, max_fetch, layer.config.kernel_backend, fetched, layer.config.keep_margin)


def block_mass(query: torch.Tensor, keys: torch.Tensor, scale: float, q_pos: torch.Tensor, kv_start: torch.Tensor,
               block_size: int, capacity_blocks: int, backend: str = "auto") -> torch.Tensor:
    """Exact causal softmax attention mass per block (`oasis_hf.kernels.block_mass`, or its twin by `backend`);
    (B, H_kv, capacity_blocks) float32."""
    mass = kernel_block_mass if use_triton(query, backend) else block_mass_ref
    return mass(query, keys, scale, q_pos, kv_start, block_size, capacity_blocks)


def exact_block_mass(layer: OasisLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H_kv, NB_cap): exact softmax attention mass of `query` per block of `layer`, from the full keys on host."""
    if layer.writeback_event is not None:
        layer.writeback_event.synchronize()
    keys = layer.cache.host.read_keys(layer.layer_idx, layer.length).to(layer.device)
    num_tokens = query.shape[2]
    q_pos = layer.length - num_tokens + torch.arange(num_tokens, device=layer.device)
    return block_mass(query, keys, scale, q_pos, layer.kv_start, layer.config.block_size,
                      layer.table.capacity_blocks, layer.config.kernel_backend)


def measure_recall(layer: OasisLayer, query: torch.Tensor, scale: float) -> None:
    """Exact attention of this step against what was resident when it ran, added to the cache's statistics
    (synchronises; evaluation only)."""
    if layer.device.type == "cuda":
        torch.cuda.current_stream(layer.device).synchronize()  # the graph's host write-back has landed
    mass = exact_block_mass(layer, query, scale)  # (B, H_kv, NB_cap), rows summed
    num_slots = layer.budget_blocks
    resident = layer.table.slot_block[..., :num_slots]
    held = torch.where(resident >= 0, mass.gather(-1, resident.clamp(min=0)), 0.0)
    mass_recall = (held.sum(-1) / mass.sum(-1).clamp_min(1e-30)).mean()
    top_mass, top = mass.topk(min(num_slots, mass.shape[-1]), dim=-1)
    wanted = top_mass > 0
    hit = (top[..., :, None] == resident[..., None, :]).any(-1) & wanted
    topk_recall = (hit.sum(-1) / wanted.sum(-1).clamp_min(1)).float().mean()
    layer.cache.stats.record_recall(layer.layer_idx, float(mass_recall), float(topk_recall))
