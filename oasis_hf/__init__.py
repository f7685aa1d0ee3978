"""oasis_hf: OasisKV for Hugging Face Transformers.

The full KV cache lives in host memory; the GPU holds a capped budget of KV blocks per sequence and layer, and
attention runs exactly over them. Importing this package registers nothing: call `register()` or `enable(model)`.
"""

from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.cache.pinned import PinnedPool
from oasis_hf.config import OasisConfig
from oasis_hf.decode_graph import DecodeGraph, decode_generate
from oasis_hf.errors import (
    DeviceMemoryError,
    HostMemoryError,
    OasisError,
    PinnedMemoryError,
    PrefetchError,
    RemoteTierError,
    UnsupportedError,
)
from oasis_hf.integrations.attention import ATTENTION_NAME, enable, oasis_attention, register
from oasis_hf.pipelines import OasisTextGenerationPipeline, text_generation_pipeline
from oasis_hf.speculative import SpeculativeOutput, SpeculativeStats, speculative_generate

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_NAME",
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
