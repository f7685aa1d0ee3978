"""Size an `OasisCache`'s host store when ``model.generate`` starts, from the prompt and the new tokens asked for.

`install(model)` (called by `oasis_hf.enable`, never at import) wraps the model's ``generate`` on the instance: a
call whose cache is an `OasisCache` first tells it the longest sequence the call can reach
(`OasisCache.plan_tokens`: prompt length + ``max_new_tokens``, or ``max_length``, plus room for one verification
forward of drafts), so the store is allocated for all of it at the prefill's first layer. A host memory limit (or the
machine's free memory) that does not hold it is reported there, with the longest length that fits, instead of when
the store grows in the middle of decoding.

A cache serves one generation. A second call on a cache that holds tokens must continue them (``input_ids``
starting with the tokens of the previous call's output, as transformers' continuation from a cache does); any other
prompt is refused with `UnsupportedError` before a forward runs (`OasisCache.check_prompt`), instead of failing in
a reshape or attending over the earlier prompt's K/V. Everything else about ``generate`` is transformers' own.
"""

from __future__ import annotations

import functools

import torch

from oasis_hf.cache.layer import GRAPH_MAX_TOKENS
from oasis_hf.cache.oasis_cache import OasisCache

_MARK = "_oasis_capacity"
_CACHE_KWARGS = ("past_key_values", "cache")


def planned_tokens(model, args: tuple, kwargs: dict) -> int | None:
    """The longest sequence a ``model.generate(*args, **kwargs)`` call can reach, or None when it cannot be told."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if getattr(ids, "ndim", 0) != 2:
        return None
    config = kwargs.get("generation_config") or model.generation_config
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None:
        total = kwargs.get("max_length", getattr(config, "max_length", None))
        return int(total) if total else None
    drafted = kwargs.get("assistant_model") is not None or kwargs.get("prompt_lookup_num_tokens")
    return int(ids.shape[1]) + int(new) + (GRAPH_MAX_TOKENS if drafted else 0)


def install(model) -> None:
    """Make `model.generate` plan an `OasisCache`'s host store before it starts (idempotent)."""
    if getattr(model.generate, _MARK, False):
        return
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        if not isinstance(cache, OasisCache):
            return original(*args, **kwargs)
        cache.check_prompt(kwargs.get("input_ids", args[0] if args else None))
        planned = planned_tokens(model, args, kwargs)
        if planned:
            cache.plan_tokens(planned)
        out = original(*args, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
        if isinstance(sequences, torch.Tensor):
            cache.note_output(sequences)
        return out

    setattr(generate, _MARK, True)
    model.generate = generate
