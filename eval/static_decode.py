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
number of tokens kept, as in kvpress. On the CPU (and with ``graphs=False``) the same loop runs eagerly; the tokens
are those of ``model.generate`` over the same cache (tested).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from oasis_hf import compat
from oasis_hf.cache.pinned import capturing
from oasis_hf.errors import UnsupportedError


def greedy_continue(model, cache, first_ids: torch.Tensor, position: int, max_new_tokens: int,
                    eos_token_id: int | list[int] | None = None, graphs: bool = True) -> torch.Tensor:
    """Greedy tokens after `first_ids`, decoding over a copy of the prefilled `cache`.

    Parameters
    ----------
    model : a causal LM (any attention implementation transformers builds masks for, the "oasis" attention of
        `oasis_hf.enable` included: its mask function gives a StaticCache transformers' 4-D mask).
    cache : a `DynamicCache` holding the prompt's KV (``(1, kv_heads, kept, head_dim)`` per layer, the same ``kept``
        in every layer, as kvpress's scorer presses leave it); it is not modified.
    first_ids : (1, 1) the first generated token (the argmax of the prefill's last logits).
    position : rotary position of `first_ids`: the prompt's length before any compression.
    max_new_tokens : tokens to generate after `first_ids` at most.
    eos_token_id : stop after generating one of these.
    graphs : capture the step as a CUDA graph on CUDA (the first step runs eagerly as warm-up).

    Returns
    -------
    (1, 1 + n) `first_ids` followed by the ``n <= max_new_tokens`` tokens generated.
    """
    if first_ids.shape != (1, 1):
        raise UnsupportedError(f"greedy_continue decodes one sequence; first_ids has shape {tuple(first_ids.shape)}")
    lengths = {layer.keys.shape[-2] for layer in cache.layers}
    if len(lengths) != 1 or any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise UnsupportedError(
            f"greedy_continue needs every cache layer to hold the same number of full-attention tokens (got lengths "
            f"{sorted(lengths)}); decode with model.generate instead")
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    if max_new_tokens < 1 or first_ids.item() in stops:
        return first_ids
    return _decode(model, cache, first_ids, position, max_new_tokens, stops, graphs, lengths.pop())


def _decode(model, cache, first_ids, position: int, max_new_tokens: int, stops: set, graphs: bool,
            kept: int) -> torch.Tensor:
    tokens = [first_ids]
    static = StaticCache(config=model.config, max_cache_len=kept + max_new_tokens)
    for layer, source in zip(static.layers, cache.layers, strict=True):
        layer.update(source.keys, source.values)
    ids = first_ids.clone()
    positions = torch.full((1, 1), position, dtype=torch.long, device=first_ids.device)
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
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt.clone())
        if index + 1 == max_new_tokens or nxt.item() in stops:
            break
        ids.copy_(nxt)
        positions.add_(1)
    return torch.cat(tokens, dim=1)
