"""A layer's prefill forwards: dense attention over the prompt, the block summaries, the first selection.

- `prefill`: the first forward on an empty cache. Dense attention over the chunk, summaries of every block, the
  initial selection copied into the pool straight from the chunk's K/V (no host read), each one launch on CUDA
  (`summarize_keys`, `plan_blocks`, `fill_pool`) reading the K/V where the model left them;
- `prefill_chunk`: a long forward on a non-empty cache (chunked prefill): exact dense attention over the whole
  sequence, the earlier part read back from host memory, then the touched summaries and a new selection;
- `padding_starts`: each sequence's first real position from the 2-D left-padding mask (one synchronisation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasis_hf.cache.scoring import block_mass, block_scores, plan
from oasis_hf.errors import UnsupportedError
from oasis_hf.kernels import fill_pool, fill_pool_ref, use_triton
from oasis_hf.kernels.dense import dense_attention

if TYPE_CHECKING:
    from oasis_hf.cache.layer import OasisLayer


#: Bytes of float32 temporaries one `block_mass` call of the prefill window may hold on the PyTorch path
#: (`prefill_scores`; the Triton kernel holds none of that size).
MASS_CHUNK_BYTES = 256 * 2**20


def _fill_pool(layer: OasisLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Every resident slot of `layer` from `keys`/`values` (B, H_kv, L, D), positions ``0 .. L - 1``."""
    fill = fill_pool if use_triton(keys, layer.config.kernel_backend) else fill_pool_ref
    fill(keys, values, layer.table.slot_block, layer.pool_k, layer.pool_v)


def prefill(layer: OasisLayer, query, key, value, attention_mask, scale: float, end: int) -> torch.Tensor:
    """The first forward of `layer` (positions ``0 .. end - 1``): (B, H_q, T, D) queries -> (B, T, H_q, D)."""
    starts, pads = layer.cache.padding_starts(attention_mask, layer.batch_size, end, layer.device)
    if layer.kv_start is None:
        layer.kv_start = starts
    elif layer.kv_start is not starts:  # a reset layer: in place, where its captured graphs read it
        layer.kv_start.copy_(starts)
    out = dense_attention(query, key, value, attention_mask, scale, pad_lengths=pads)
    layer.summaries.write(key, layer.kv_start, 0, layer.config.kernel_backend)
    plan(layer, prefill_scores(layer, query, key, scale, 0, end), max_fetch=None, counter="prefilled")
    # The pool is empty, so every chosen block is a miss: copied from the chunk's K/V, not from host.
    _fill_pool(layer, key, value)
    layer.cache.stats.record_prefill(layer.layer_idx)
    return out


def prefill_chunk(layer: OasisLayer, query, key, value, attention_mask, scale: float, start: int,
                  end: int) -> torch.Tensor:
    """A long forward on a non-empty cache (positions ``start .. end - 1``): exact dense attention over the layer's
    whole sequence, the earlier part read back from host memory (one zero-copy gather on CUDA). GPU memory holds one
    layer's K/V at a time, not the model's. Then the summaries of the blocks it touched, and a new selection from its
    last query, with every resident slot refilled from the full K/V."""
    layer.jobs.await_job()
    if layer.writeback_event is not None:  # every earlier row has landed in host memory
        torch.cuda.current_stream(layer.device).wait_event(layer.writeback_event)
        layer.writeback_event = None
    past_k, past_v = layer.cache.host.read_range(layer.layer_idx, start, layer.device)
    full_k, full_v = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
    del past_k, past_v
    out = dense_attention(query, full_k, full_v, attention_mask, scale)
    layer.summaries.write(full_k, layer.kv_start, start // layer.config.block_size, layer.config.kernel_backend)
    # The selection memory starts afresh, as after one whole prefill: a chunked prefill then selects the same
    # blocks (given a last chunk of at least `prefill_window_tokens` tokens).
    layer.score_memory.zero_()
    plan(layer, prefill_scores(layer, query, full_k, scale, start, end), max_fetch=None)
    _fill_pool(layer, full_k, full_v)
    return out


def prefill_scores(layer: OasisLayer, query, keys, scale: float, start: int, end: int) -> torch.Tensor:
    """Scores of the first selection after a prefill forward holding positions ``start .. end - 1``.

    query : (B, H_q, end - start, D) the forward's queries; keys : (B, H_kv, end, D) every key so far, on the
    device. With `OasisConfig.prefill_window_tokens` ``W > 0`` (selectors that take it: not `static` or `oracle`)
    the exact attention mass of the last ``W`` queries, else the last query against the summaries.
    """
    last = torch.full((), end - 1, dtype=torch.long, device=layer.device)
    window = min(layer.config.prefill_window_tokens, query.shape[2])
    if window == 0 or not layer.cache.selector.window_and_memory:
        return block_scores(layer, query[:, :, -1:], scale, last)
    q = query[:, :, -window:]
    q_pos = torch.arange(end - window, end, device=layer.device)
    heads = layer.num_kv_heads
    group = q.shape[1] // heads
    backend = layer.config.kernel_backend
    if use_triton(q, backend):  # the kernel holds no temporaries of that size: the whole batch in one call
        pairs = layer.batch_size * heads
    else:
        # As many (sequence, KV head) pairs per call as fit in MASS_CHUNK_BYTES of the twin's float32 temporaries
        # (the G * W rows' logits and probabilities, the keys in float32): the whole batch in one call at 16k tokens
        # on Qwen2.5-1.5B, a few calls at 32k on Llama-8B's shape, one KV head at a time only beyond that.
        pairs = max(1, MASS_CHUNK_BYTES // (4 * end * (4 * group * window + layer.head_dim)))
    sequences, heads_per = (max(1, pairs // heads), heads) if pairs >= heads else (1, pairs)
    capacity = layer.table.capacity_blocks
    if sequences >= layer.batch_size and heads_per >= heads:  # one call: its result feeds the scores as it is
        mass = block_mass(q, keys, scale, q_pos, layer.kv_start, layer.config.block_size, capacity, backend)
        return block_scores(layer, q, scale, last, num_tokens=1, raw=mass)
    mass = torch.zeros(layer.batch_size, heads, capacity, device=layer.device)
    for b in range(0, layer.batch_size, sequences):
        for h in range(0, heads, heads_per):
            mass[b : b + sequences, h : h + heads_per] = block_mass(
                q[b : b + sequences, h * group : (h + heads_per) * group], keys[b : b + sequences, h : h + heads_per],
                scale, q_pos, layer.kv_start[b : b + sequences], layer.config.block_size, capacity, backend,
            )
    return block_scores(layer, q, scale, last, num_tokens=1, raw=mass)


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
