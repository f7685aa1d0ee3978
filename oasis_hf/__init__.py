"""oasis_hf: OasisKV for Hugging Face Transformers.

The full KV cache lives in host memory; the GPU holds a capped budget of KV blocks per sequence and layer, and
attention runs exactly over them. Importing this package registers nothing: call `register()` or `enable(model)`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from oasis_hf.errors import (
    DeviceMemoryError,
    HostMemoryError,
    OasisError,
    PinnedMemoryError,
    PrefetchError,
    RemoteTierError,
    UnsupportedError,
)

if TYPE_CHECKING:
    from oasis_hf.cache.oasis_cache import OasisCache
    from oasis_hf.cache.pinned import PinnedPool
    from oasis_hf.cache.slot import CacheSlot
    from oasis_hf.config import OasisConfig
    from oasis_hf.decode_graph import DecodeGraph, decode_generate
    from oasis_hf.integrations.attention import ATTENTION_NAME, enable, oasis_attention, register
    from oasis_hf.pipelines import OasisTextGenerationPipeline, text_generation_pipeline
    from oasis_hf.speculative import SpeculativeOutput, SpeculativeStats, speculative_generate

#: Public names that live in submodules importing torch and transformers: loaded on first use, so ``import
#: oasis_hf`` (and ``oasis-hf --help``) costs nothing until a cache or model is touched.
_LAZY = {
    "OasisCache": "oasis_hf.cache.oasis_cache",
    "PinnedPool": "oasis_hf.cache.pinned",
    "CacheSlot": "oasis_hf.cache.slot",
    "OasisConfig": "oasis_hf.config",
    "DecodeGraph": "oasis_hf.decode_graph",
    "decode_generate": "oasis_hf.decode_graph",
    "ATTENTION_NAME": "oasis_hf.integrations.attention",
    "enable": "oasis_hf.integrations.attention",
    "oasis_attention": "oasis_hf.integrations.attention",
    "register": "oasis_hf.integrations.attention",
    "OasisTextGenerationPipeline": "oasis_hf.pipelines",
    "text_generation_pipeline": "oasis_hf.pipelines",
    "SpeculativeOutput": "oasis_hf.speculative",
    "SpeculativeStats": "oasis_hf.speculative",
    "speculative_generate": "oasis_hf.speculative",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oasis_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "ATTENTION_NAME",
    "CacheSlot",
    "DecodeGraph",
    "decode_generate",
    "DeviceMemoryError",
    "HostMemoryError",
    "OasisCache",
    "OasisConfig",
    "OasisError",
    "OasisTextGenerationPipeline",
    "PinnedMemoryError",
    "PinnedPool",
    "PrefetchError",
    "RemoteTierError",
    "SpeculativeOutput",
    "SpeculativeStats",
    "UnsupportedError",
    "enable",
    "oasis_attention",
    "register",
    "speculative_generate",
    "text_generation_pipeline",
]
