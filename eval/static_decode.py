"""Greedy decoding that continues a prefilled (for instance kvpress-compressed) `DynamicCache`, one CUDA graph per step.

kvpress compresses the prompt's KV during the prefill forward; decoding then attends to the kept tokens plus the new
ones. Through transformers' ``generate`` that decode loop cost at least 30 ms per token for a 1.5B model at
batch 1 on an H200 (measured in ``eval.accuracy``), which made the kvpress rows most of the accuracy preset's time.
`greedy_continue` copies the cache into a transformers `StaticCache` with room for the new tokens and runs each
step as a replay of one captured model forward, like kvpress's own pipeline decodes after its compressed prefill:

    with press(model):
        out = model(input_ids=prompt, past_key_values=cache)            # compressed prefill (kvpress's API)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    new = greedy_continue(model, cache, first, position=prompt.shape[1], max_new_tokens=63, eos_token_id=eos)

Rotary positions continue from the *original* prompt length (``position``), while the cache slots continue from the
number of tokens kept, as in kvpress. A batch of compressed caches that kept the same number of tokens decodes
together (`stack_caches`, one position per row): a press compresses one prompt at a time, but its decode steps need
not run one at a time. On the CPU (and with ``graphs=False``) the same loop runs eagerly; the tokens are those of
``model.generate`` over the same cache (tested).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, StaticCache

from oasis_hf import compat
from oasis_hf.cache.pinned import capturing
from oasis_hf.errors import UnsupportedError


def stack_caches(caches: list[DynamicCache]) -> DynamicCache:
    """One `DynamicCache` of batch ``len(caches)`` from single-sequence caches that hold the same number of tokens in
    every layer (what a scorer press leaves at one budget); the inputs are not modified."""
    lengths = {layer.keys.shape[-2] for cache in caches for layer in cache.layers}
    if len(lengths) != 1 or len({len(cache.layers) for cache in caches}) != 1:
        raise UnsupportedError(f"stack_caches needs caches of one length and depth (got lengths {sorted(lengths)}); "
                               "decode them one at a time instead")
    stacked = DynamicCache()
    for index in range(len(caches[0].layers)):
        stacked.update(torch.cat([cache.layers[index].keys for cache in caches]),
                       torch.cat([cache.layers[index].values for cache in caches]), index)
    return stacked


def greedy_continue(model, cache, first_ids: torch.Tensor, position: int | list[int], max_new_tokens: int,
                    eos_token_id: int | list[int] | None = None, graphs: bool = True,
                    pad_token_id: int | None = None) -> torch.Tensor:
    """Greedy tokens after `first_ids`, decoding over a copy of the prefilled `cache`.

    Parameters
    ----------
    model : a causal LM (any attention implementation transformers builds masks for, the "oasis" attention of
        `oasis_hf.enable` included: its mask function gives a StaticCache transformers' 4-D mask).
    cache : a `DynamicCache` holding the prompts' KV (``(B, kv_heads, kept, head_dim)`` per layer, the same ``kept``
        in every layer, as kvpress's scorer presses leave it; `stack_caches` builds one from single prompts); it is
        not modified.
    first_ids : (B, 1) the first generated token of each row (the argmax of the prefill's last logits).
    position : rotary position of `first_ids`: each prompt's length before any compression (an int for B = 1).
    max_new_tokens : tokens to generate after `first_ids` at most.
    eos_token_id : a row stops after generating one of these; decoding stops once every row has.
    graphs : capture the step as a CUDA graph on CUDA (the first step runs eagerly as warm-up).
    pad_token_id : what a stopped row gets while the others decode (default: the smallest stop id, 0 without any).

    Returns
    -------
    (B, 1 + n) `first_ids` followed by the ``n <= max_new_tokens`` tokens generated.
    """
    positions = [position] if isinstance(position, int) else [int(p) for p in position]
    if first_ids.dim() != 2 or first_ids.shape[1] != 1 or first_ids.shape[0] != len(positions):
        raise UnsupportedError(f"greedy_continue takes first_ids of shape (B, 1) and one position per row; got "
                               f"{tuple(first_ids.shape)} and {len(positions)} positions")
    lengths = {layer.keys.shape[-2] for layer in cache.layers}
    batches = {layer.keys.shape[0] for layer in cache.layers}
    if len(lengths) != 1 or any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise UnsupportedError(
            f"greedy_continue needs every cache layer to hold the same number of full-attention tokens (got lengths "
            f"{sorted(lengths)}); decode with model.generate instead")
    if batches != {len(positions)}:
        raise UnsupportedError(f"the cache holds batch {sorted(batches)} but first_ids has {len(positions)} rows")
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    stop_ids = torch.tensor(sorted(stops), dtype=first_ids.dtype, device=first_ids.device)
    finished = torch.isin(first_ids[:, 0], stop_ids)
    if max_new_tokens < 1 or bool(finished.all()):
        return first_ids
    fill = pad_token_id if pad_token_id is not None else (min(stops) if stops else 0)
    return _decode(model, cache, first_ids, positions, max_new_tokens, stop_ids, finished, fill, graphs,
                   lengths.pop())


def _decode(model, cache, first_ids, position: list[int], max_new_tokens: int, stop_ids: torch.Tensor,
            finished: torch.Tensor, fill: int, graphs: bool, kept: int) -> torch.Tensor:
    tokens = [first_ids]
    static = StaticCache(config=model.config, max_cache_len=kept + max_new_tokens)
    for layer, source in zip(static.layers, cache.layers, strict=True):
        layer.update(source.keys, source.values)
    ids = first_ids.clone()
    positions = torch.tensor(position, dtype=torch.long, device=first_ids.device)[:, None]
    kwargs = {compat.cache_kwarg(model): static, "use_cache": True}

    def step() -> torch.Tensor:
        return model(input_ids=ids, position_ids=positions, **kwargs).logits[:, -1]

    graph = logits = None
    for index in range(max_new_tokens):
        if graph is not None:
            graph.replay()
        elif graphs and ids.is_cuda and index == 0:  # warm-up (a real step) on a side stream, as capture wants
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = step()
            torch.cuda.current_stream().wait_stream(side)
        elif graphs and ids.is_cuda and index == 1:  # capture from step 1 on; the capture itself computes nothing
            graph = torch.cuda.CUDAGraph()
            with capturing(), torch.cuda.graph(graph):
                logits = step()
            graph.replay()
        else:
            logits = step()
        nxt = logits.argmax(-1, keepdim=True).masked_fill(finished[:, None], fill)
        tokens.append(nxt.clone())
        finished |= torch.isin(nxt[:, 0], stop_ids)
        if index + 1 == max_new_tokens or bool(finished.all()):  # one host synchronisation per step, as before
            break
        ids.copy_(nxt)
        positions.add_(1)
    return torch.cat(tokens, dim=1)
