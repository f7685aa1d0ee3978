"""transformers pipelines with OasisKV: every generate call the pipeline makes runs over the pipeline's
`OasisCache`, reset after it (`oasis_hf.CacheSlot`).

A cache holds one batch of sequences, so a cache handed to a pipeline (``pipe(prompts, past_key_values=cache)``)
would be reused for the next prompt without a reset and give wrong output; `OasisTextGenerationPipeline` refuses it
and keeps a cache of its own, built from its `OasisConfig` and reset after every call: its GPU buffers, host store
and captured graphs serve every batch of the same size (the first decode step of a call replays the graph instead of
capturing one). A cache made anew (another batch size, a failed call) takes its host store from the pipeline's
`PinnedPool`, so the page-locking of host memory (about 2.5 GB/s) is paid once.

    >>> import oasis_hf
    >>> pipe = oasis_hf.text_generation_pipeline(model, tokenizer, oasis_hf.OasisConfig(budget_tokens=2048))
    >>> pipe(["long prompt 1", "long prompt 2"], max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

from transformers import TextGenerationPipeline, pipeline

from oasis_hf import compat
from oasis_hf.cache.pinned import PinnedPool
from oasis_hf.cache.slot import CacheSlot
from oasis_hf.config import OasisConfig
from oasis_hf.errors import UnsupportedError
from oasis_hf.integrations.attention import enable


class OasisTextGenerationPipeline(TextGenerationPipeline):
    """`TextGenerationPipeline` whose generate calls run over its own `OasisCache`, reset after each
    (``pipe.cache_slot``, a `oasis_hf.CacheSlot`).

    Extra parameters: ``oasis_config`` (`OasisConfig`, default ``OasisConfig()``) and ``host_pool`` (a `PinnedPool`
    the caches take their host store from and return it to; default: one of the pipeline's own, which keeps up to
    its ``max_buffers`` host buffers page-locked while the pipeline lives). ``pipe.cache_slot.close()`` frees the
    cache's memory and ``pipe.host_pool.clear()`` the pool's. The model is switched to the ``"oasis"`` attention
    (`oasis_hf.enable`). ``assistant_model=`` and other generate arguments pass through.
    """

    def __init__(self, *args, oasis_config: OasisConfig | None = None, host_pool: PinnedPool | None = None,
                 **kwargs) -> None:
        self.oasis_config = oasis_config or OasisConfig()
        self.host_pool = host_pool if host_pool is not None else PinnedPool()
        super().__init__(*args, **kwargs)
        enable(self.model)
        self.cache_slot = CacheSlot(self.model.config, self.oasis_config, host_pool=self.host_pool)

    def _forward(self, model_inputs, **generate_kwargs):
        for key in ("past_key_values", "cache"):
            if generate_kwargs.get(key) is not None:
                raise UnsupportedError(
                    f"do not pass {key}= to an OasisKV pipeline: one cache would be reused across prompts and give "
                    "wrong output. The pipeline keeps an OasisCache of its own, reset after every call; configure "
                    "it with oasis_config=OasisConfig(...)"
                )
        with self.cache_slot.cache() as cache:
            generate_kwargs[compat.cache_kwarg(self.model)] = cache
            return super()._forward(model_inputs, **generate_kwargs)


def text_generation_pipeline(model, tokenizer, config: OasisConfig | None = None, **kwargs):
    """``pipeline("text-generation", model=model, tokenizer=tokenizer, ...)`` running on OasisKV."""
    return pipeline("text-generation", model=model, tokenizer=tokenizer, pipeline_class=OasisTextGenerationPipeline,
                    oasis_config=config, **kwargs)
