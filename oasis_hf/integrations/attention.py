"""The ``"oasis"`` attention function and its explicit registration.

Nothing is registered at import. `register()` adds ``"oasis"`` to transformers' `AttentionInterface` and
`oasis_mask` to `AttentionMaskInterface`; `enable(model)` also switches a model to it and installs the whole-step
graph path for its decode forwards. Calls whose key was not returned by an `OasisLayer` (sliding-window layers, a
draft model, an lm-eval loglikelihood forward with its own cache, early-exit drafting, a preallocated
`StaticCache`) run dense attention.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from oasis_hf import compat
from oasis_hf.cache import step_op
from oasis_hf.cache.layer import layer_of, windowed
from oasis_hf.errors import UnsupportedError
from oasis_hf.integrations import capacity, fast_path, queued_generate
from oasis_hf.kernels.dense import dense_attention

ATTENTION_NAME = "oasis"


def oasis_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers models: `query` (B, H_q, T, D) -> output (B, T, H_q, D), no weights.

    The parameter order is transformers' own (``sdpa_attention_forward``: mask, then ``dropout``, then
    ``scaling``): wrappers that pass ``dropout`` by position, such as the one kvpress installs around every
    registered attention function when it is imported, must land it in ``dropout``. Inside a compiled whole-step
    forward (the `step_op.STEP_KWARG` keyword) it is one opaque operator, so the compiler traces through;
    elsewhere a compiled model breaks its graph here.
    """
    if kwargs.get("softcap") is not None:
        raise UnsupportedError("oasis attention does not implement logit soft-capping (Gemma2-style 'softcap')")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kwargs.get(step_op.STEP_KWARG):
        _check_no_dropout(dropout)
        return step_op.attention(query, key, value, module.layer_idx, scale), None
    return _attention(module, query, key, value, attention_mask, dropout, scale, **kwargs)


def _check_no_dropout(dropout: float) -> None:
    if dropout:
        raise UnsupportedError("OasisCache is for inference: attention dropout must be 0 (call model.eval())")


@torch.compiler.disable  # the layer's step is ours: host state and our kernels
def _attention(module, query, key, value, attention_mask, dropout: float, scale: float, **kwargs):
    layer = layer_of(key)
    if attention_mask is not None and attention_mask.dim() == 4:  # keys beyond the queries: see `oasis_mask`
        if layer is not None:
            raise UnsupportedError("an OasisCache layer got a 4-D attention mask; register the mask function with "
                                   "oasis_hf.register() (oasis_hf.enable does) instead of building 4-D masks")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scale,
                                      **kwargs)
    if layer is None and windowed(key) and kwargs.get("sliding_window") is None:
        raise UnsupportedError(
            f"model layer {getattr(module, 'layer_idx', '?')} attends over the whole sequence, but this OasisCache "
            "holds it as a sliding-window layer (the last tokens only): the cache was built for a config with other "
            "layer types; build it from this model's config: OasisCache(model.config, ...)"
        )
    if layer is None:
        step_op.check_not_running(getattr(module, "layer_idx", "?"))
        out = dense_attention(
            query, key, value, attention_mask, scale,
            sliding_window=kwargs.get("sliding_window"),
            is_causal=getattr(module, "is_causal", True),
            dropout=dropout,
        )  # fmt: skip
        return out, None
    _check_no_dropout(dropout)
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedError(
            f"model layer {getattr(module, 'layer_idx', '?')} attends over a sliding window, but this OasisCache "
            f"holds it as a full-attention layer: the cache was built for a config with other layer types; build it "
            "from this model's config: OasisCache(model.config, ...)"
        )
    if query.is_cuda:  # a model split across GPUs runs this layer on its own device, whatever the current one is
        with torch.cuda.device(query.device):
            return layer.attend(query, key, value, attention_mask, scale), None
    return layer.attend(query, key, value, attention_mask, scale), None


def oasis_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask the oasis attention takes: a 2-D padding mask (B, L) or None where the queries are the last
    `q_length` of the `kv_length` keys (an `OasisCache`, a `DynamicCache`), so no dense (B, 1, T, L) mask is built;
    transformers' 4-D boolean SDPA mask (B, 1, T, L) where keys extend past the last query (a preallocated
    `StaticCache`, whose unwritten slots follow the written ones), which `oasis_attention` hands to SDPA."""
    if isinstance(q_offset, torch.Tensor) or q_offset + q_length < kv_offset + kv_length:
        # An offset held on the device is a StaticCache's (OasisCache counts on the host): its 4-D mask, built
        # without reading the offset back, so that it can be captured in a CUDA graph.
        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, attention_mask=attention_mask, allow_is_causal_skip=False, **kwargs)
    return compat.flash_attention_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                        q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register(name: str = ATTENTION_NAME) -> str:
    """Register the oasis attention and mask functions under `name` (idempotent); returns the name."""
    AttentionInterface.register(name, oasis_attention)
    AttentionMaskInterface.register(name, oasis_mask)
    return name


def enable(model, name: str = ATTENTION_NAME):
    """Register the attention, switch `model` (text part only for multimodal models) to it, install the whole-step
    graph path for its decode forwards over an `OasisCache` (`oasis_hf.integrations.fast_path`; opt out per cache
    with `OasisConfig.whole_step=False`), the host store's sizing when ``generate`` starts
    (`oasis_hf.integrations.capacity`) and, on that path, ``generate``'s loop without a device sync per step
    (`oasis_hf.integrations.queued_generate`; opt out with `OasisConfig.queued_generate=False`); returns `model`."""
    register(name)
    config = model.config
    if getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None:
        model.set_attn_implementation({"text_config": name, "vision_config": "sdpa"})
    else:
        model.set_attn_implementation(name)
    fast_path.install(model)
    capacity.install(model)
    queued_generate.install(model)
    return model
