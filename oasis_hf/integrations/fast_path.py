"""The whole-step graph path for ``model(...)`` and ``model.generate``: decode forwards over an `OasisCache` replay
one CUDA graph of the whole model (`oasis_hf.DecodeGraph`) instead of running its eager modules.

`install(model)` (called by `oasis_hf.enable`, never at import) wraps the model's ``forward`` on the instance. The
wrapper keeps the original signature (transformers' generate inspects it: ``logits_to_keep``, ``cache_position``)
and routes a call to the cache's `OasisCache.graph_runner` when all of these hold:

- the call's cache is an `OasisCache` holding tokens (a decode or verification forward, not the prefill) with
  `OasisConfig.whole_step` and `OasisConfig.cuda_graphs` set, on a device in `GRAPH_DEVICES` (CUDA; the CPU runs
  eagerly);
- the forward brings at most `GRAPH_MAX_TOKENS` new ``input_ids`` (no ``inputs_embeds``), asks for no attentions or
  hidden states, and ``logits_to_keep`` is an int;
- `oasis_hf.decode_graph.unsupported` finds nothing the graph cannot capture.

Every other call runs the model's own forward. Calls with another cache (a draft model's, a dense one) or with an
OasisCache that opted out, or on the CPU, fall through silently; an OasisCache forward that wanted the graph path
and cannot take it logs the reason once per model and reason. Generation itself stays transformers' own: stopping
criteria, logits processors, streamers and EOS handling see the logits the graph returns.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from oasis_hf.cache.layer import GRAPH_MAX_TOKENS
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.decode_graph import graph_runner, unsupported

logger = logging.getLogger(__name__)

#: Device types whose decode forwards take the graph path (the CPU's whole-step path is eager: no gain there).
GRAPH_DEVICES = ("cuda",)
_MARK = "_oasis_fast_path"
_CACHE_KWARGS = ("past_key_values", "cache")


def install(model) -> None:
    """Route `model`'s decode forwards over an `OasisCache` through the whole-step graph (idempotent)."""
    if getattr(model.forward, _MARK, False):
        return
    original = model.forward
    logged: set[str] = set()

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        if not isinstance(cache, OasisCache) or not cache.config.whole_step or cache.in_whole_step or args:
            return original(*args, **kwargs)  # not ours, opted out, or the DecodeGraph's own forward running
        reason = _eager_reason(model, cache, kwargs)
        if reason is None:
            return _graph_forward(model, cache, kwargs)
        if reason and reason not in logged:
            logged.add(reason)
            logger.info("oasis_hf: decode forwards of %s run eagerly: %s", type(model).__name__, reason)
        return original(*args, **kwargs)

    setattr(forward, _MARK, True)
    model.forward = forward


def _eager_reason(model, cache: OasisCache, kwargs: dict) -> str | None:
    """Why this forward runs the model's own forward: "" for the silent cases (the prefill, the CPU), a message
    otherwise; None when the graph path takes it."""
    input_ids = kwargs.get("input_ids")
    if input_ids is None or cache.get_seq_length() == 0:
        return ""  # the prefill (or embeddings passed in): dense attention over the prompt, eager by design
    if input_ids.device.type not in GRAPH_DEVICES or not cache.config.cuda_graphs:
        return ""  # the CPU's path is eager anyway; cuda_graphs=False asks for no graphs at all
    if input_ids.shape[1] > GRAPH_MAX_TOKENS:
        return f"a forward of {input_ids.shape[1]} new tokens is above the {GRAPH_MAX_TOKENS} the graphs capture"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds: the graph captures input_ids"
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return "attention weights or hidden states requested: the graph returns logits only"
    if not isinstance(kwargs.get("logits_to_keep", 0), int):
        return "logits_to_keep given as indices: the graph keeps the last positions only"
    if kwargs.get("labels") is not None:
        return "labels (a loss): the graph returns logits only"
    runner = cache.graph_runner
    if runner is not None and runner.model is model:
        return runner.unsupported()  # checked once per table epoch
    return unsupported(cache)


def _graph_forward(model, cache: OasisCache, kwargs: dict):
    """One `DecodeGraph` forward standing in for ``model(**kwargs)``: the same logits and cache."""
    input_ids = kwargs["input_ids"]
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # no padding mask: positions follow the cache
        cache_position = kwargs.get("cache_position")
        if cache_position is None:
            start = cache.get_seq_length()
            cache_position = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        position_ids = cache_position.view(1, -1).expand_as(input_ids)
    logits = graph_runner(model, cache)(input_ids, position_ids.to(input_ids.device).expand_as(input_ids).contiguous())
    keep = kwargs.get("logits_to_keep", 0)
    if keep:
        logits = logits[:, -keep:]
    if kwargs.get("return_dict") is False:
        return (logits, cache)
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)
