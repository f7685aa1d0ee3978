"""transformers pipelines with OasisKV: a fresh `OasisCache` for every generate call the pipeline makes.

A cache holds one batch of sequences, so a cache handed to a pipeline (``pipe(prompts, past_key_values=cache)``)
would be reused for the next prompt and give wrong output; `OasisTextGenerationPipeline` refuses it and builds a
new cache per forward from its `OasisConfig` instead. The caches take their host store from the pipeline's
`PinnedPool`, so the page-locking of host memory (about 2.5 GB/s) is paid once, not on every call.

    >>> import oasis_hf
    >>> pipe = oasis_hf.text_generation_pipeline(model, tokenizer, oasis_hf.OasisConfig(budget_tokens=2048))
    >>> pipe(["long prompt 1", "long prompt 2"], max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

from transformers import TextGenerationPipeline, pipeline

from oasis_hf import compat
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.cache.pinned import PinnedPool
from oasis_hf.config import OasisConfig
from oasis_hf.errors import UnsupportedError
from oasis_hf.integrations.attention import enable


class OasisTextGenerationPipeline(TextGenerationPipeline):
    """`TextGenerationPipeline` whose every generate call gets a fresh `OasisCache` (closed afterwards).

    Extra parameters: ``oasis_config`` (`OasisConfig`, default ``OasisConfig()``) and ``host_pool`` (a `PinnedPool`
    the caches take their host store from and return it to; default: one of the pipeline's own, which keeps up to
    its ``max_buffers`` host buffers page-locked while the pipeline lives: call ``pipe.host_pool.clear()`` to release
    them). The model is switched to the ``"oasis"`` attention (`oasis_hf.enable`). ``assistant_model=`` and other
    generate arguments pass through.
    """

    def __init__(self, *args, oasis_config: OasisConfig | None = None, host_pool: PinnedPool | None = None,
                 **kwargs) -> None:
        self.oasis_config = oasis_config or OasisConfig()
        self.host_pool = host_pool if host_pool is not None else PinnedPool()
        super().__init__(*args, **kwargs)
        enable(self.model)

    def _forward(self, model_inputs, **generate_kwargs):
        for key in ("past_key_values", "cache"):
            if generate_kwargs.get(key) is not None:
                raise UnsupportedError(
                    f"do not pass {key}= to an OasisKV pipeline: one cache would be reused across prompts and give "
                    "wrong output. The pipeline builds a fresh OasisCache per call; configure it with "
                    "oasis_config=OasisConfig(...)"
                )
        with OasisCache(self.model.config, self.oasis_config, host_pool=self.host_pool) as cache:
            generate_kwargs[compat.cache_kwarg(self.model)] = cache
            return super()._forward(model_inputs, **generate_kwargs)


def text_generation_pipeline(model, tokenizer, config: OasisConfig | None = None, **kwargs):
    """``pipeline("text-generation", model=model, tokenizer=tokenizer, ...)`` running on OasisKV."""
    return pipeline("text-generation", model=model, tokenizer=tokenizer, pipeline_class=OasisTextGenerationPipeline,
                    oasis_config=config, **kwargs)
