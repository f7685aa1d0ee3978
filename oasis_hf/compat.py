"""The one place that knows transformers-version details (5.17 .. 5.x): the decoder config of a multimodal model,
its layer types, the keyword its forward takes the cache under, logits of the last position only, cropping a cache,
the output of a decoding loop.
Integrations built on this package (and its own evaluation code) use these instead of branching on versions."""

from __future__ import annotations

from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.masking_utils import flash_attention_mask

__all__ = ["flash_attention_mask", "layer_types", "sliding_window_layer", "text_config"]


def text_config(config):
    """The decoder config of a possibly multimodal model config (Gemma3ForConditionalGeneration)."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter is not None else config


def layer_types(config) -> list[str]:
    """Per-layer attention types, as `DynamicCache(config=...)` would read them.

    5.17's `get_layer_types_and_kwargs` returns ``(types, dict)`` and 5.23 ``(types, list)``, so read the config
    ourselves: ``config.layer_types`` when present, else every layer sliding when ``sliding_window`` is set
    (Mistral-style), else every layer full attention.
    """
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


def sliding_window_layer(window: int, layer_class: type = DynamicSlidingWindowLayer) -> DynamicSlidingWindowLayer:
    """A sliding-window cache layer of `layer_class` (transformers' `DynamicSlidingWindowLayer` or a subclass)."""
    return layer_class(sliding_window=window)


def cache_kwarg(model) -> str:
    """The keyword a model's ``forward`` takes its cache by: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def last_logits_only(model) -> dict:
    """``{"logits_to_keep": 1}`` where the model's ``forward`` takes it (every causal LM of transformers 5), else
    ``{}``: a prefill that needs only the last position's logits must not build (B, P, V) of them, which at 8 x
    16k tokens and Qwen's 152k vocabulary is 39 GiB in bf16 (and twice that once cast to float)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def crop_to(cache, keep: int) -> None:
    """Shorten `cache` to `keep` tokens. A negative count removes tokens in 5.17 and 5.18+ alike (a positive one
    means "keep" in 5.17 and raises in 5.18+), and ``crop(0)`` empties a 5.17 cache, so it is never called."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def decoder_only_output(sequences, scores, logits, cache):
    """transformers' ``GenerateDecoderOnlyOutput`` of a greedy / sampling loop; its cache field is ``cache``
    (transformers >= 5.2x) or ``past_key_values`` (5.17)."""
    from dataclasses import fields

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    name = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **{name: cache})
