"""The lm-eval harness model ``oasis``: transformers generation with a fresh `OasisCache` per request batch.

Registration is explicit (`register_lm_eval`); the command line below registers and then runs lm-eval's own CLI,
so every lm-eval option works as usual:

    python -m oasis_hf.tasks.make --out suite --lengths 8192 16384 --samples 50      # RULER-style tasks
    python -m oasis_hf.integrations.lm_eval --model oasis \\
        --model_args pretrained=qwen2.5-coder-1.5b-instruct,budget=2048,draft=qwen2.5-coder-0.5b-instruct \\
        --include_path suite --tasks oasis_ruler --batch_size 1

``model_args`` (besides HFLM's own): ``budget`` (tokens, default 2048), ``selector`` (default ``lookahead``),
``block_size`` (32), ``max_fetch_blocks`` (16), ``draft`` (packaged name / folder / Hub id of an assistant model,
used for batch-1 requests), ``prompt_lookup`` (prompt-lookup drafts per step, 0 = off), ``dense`` (True: plain
`DynamicCache`, the baseline under the same harness and prompts), ``press`` (a kvpress press class name such as
``SnapKVPress`` or ``ExpectedAttentionPress``: dense `DynamicCache` generation with kvpress compressing the prompt's
KV to ``budget`` tokens per layer and head, through kvpress's own API; batch size 1). ``pretrained`` may be a
packaged model name (`oasis_hf.models`), which is assembled on first use. Loglikelihood requests are single
forwards without a cache and run dense attention.
"""

from __future__ import annotations

import inspect
import logging
import sys

import torch
from lm_eval.models.huggingface import HFLM

from oasis_hf import _compat, models
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.config import OasisConfig
from oasis_hf.errors import UnsupportedError
from oasis_hf.integrations.attention import enable

logger = logging.getLogger(__name__)

MODEL_NAME = "oasis"


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


class OasisLM(HFLM):
    """HFLM whose `generate` calls run on OasisKV (or on `DynamicCache` with ``dense=True``)."""

    def __init__(self, pretrained, budget: int = 2048, selector: str = "lookahead", block_size: int = 32,
                 max_fetch_blocks: int = 16, draft: str | None = None, prompt_lookup: int = 0, dense: bool = False,
                 draft_model=None, press: str | None = None, **kwargs) -> None:
        if isinstance(pretrained, str) and pretrained in models.REGISTRY:
            from transformers import AutoTokenizer

            path = models.assemble(pretrained)
            pretrained, kwargs["gguf_file"] = str(path.parent), path.name
            if kwargs.get("tokenizer") is None:  # HFLM would not pass gguf_file to the tokenizer
                kwargs["tokenizer"] = AutoTokenizer.from_pretrained(pretrained, gguf_file=path.name)
        super().__init__(pretrained=pretrained, **kwargs)
        self.press = _make_press(press, self.model) if press else None
        self.dense = _bool(dense) or self.press is not None
        self.budget = int(budget)
        block_size = int(block_size)
        fields = dict(budget_tokens=int(budget), selector=selector, block_size=block_size,
                      max_fetch_blocks=int(max_fetch_blocks))
        if block_size < 32:
            fields.update(sink_tokens=block_size, recent_tokens=4 * block_size)
        self.oasis_config = OasisConfig(**fields)  # validated even for dense runs: a typo must not pass silently
        self.prompt_lookup = int(prompt_lookup)
        self.draft = draft_model  # a loaded assistant model (Python API), or `draft` loaded here (command line)
        if draft and self.draft is None:
            self.draft = models.load(draft, device=str(self.device), dtype=self.model.dtype)[0]
        if not self.dense:
            enable(self.model)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        if self.press is not None:
            if context.shape[0] != 1:
                raise UnsupportedError("kvpress baselines compress one prompt at a time: run with --batch_size 1")
            # The same KV size as OasisKV at this budget: keep `budget` of the prompt's tokens per layer and head.
            self.press.compression_ratio = max(0.0, 1.0 - self.budget / context.shape[1])
            with self.press(self.model):
                return super()._model_generate(context, max_length, stop, **generation_kwargs)
        if self.dense:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        if self.draft is not None and context.shape[0] == 1:
            generation_kwargs["assistant_model"] = self.draft
        elif self.prompt_lookup:
            generation_kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        with OasisCache(self.model.config, self.oasis_config) as cache:
            generation_kwargs[_compat.cache_kwarg(self.model)] = cache
            return super()._model_generate(context, max_length, stop, **generation_kwargs)


def _make_press(name: str, model):
    """A kvpress press by class name, after checking that this transformers still hands attention modules the
    cache under the argument name kvpress 0.5.5 reads (``past_key_values``; transformers 5.18+ renamed it)."""
    try:
        import kvpress
    except ImportError as exc:
        raise UnsupportedError(f"press={name!r} needs kvpress (pip install kvpress)") from exc
    press_cls = getattr(kvpress, name, None)
    if press_cls is None or not name.endswith("Press"):
        choices = sorted(n for n in dir(kvpress) if n.endswith("Press"))
        raise UnsupportedError(f"kvpress has no press {name!r}; choose one of {choices}")
    attention = next((m for n, m in model.named_modules() if n.endswith("self_attn")), None)
    if attention is not None and "past_key_values" not in inspect.signature(attention.forward).parameters:
        import transformers

        raise UnsupportedError(
            f"kvpress {getattr(kvpress, '__version__', '')} reads `past_key_values` from the attention modules' "
            f"arguments, which transformers {transformers.__version__} passes as `cache`: run the kvpress baselines "
            "with transformers 5.17 (kvpress declares transformers<5.3)"
        )
    return press_cls(compression_ratio=0.0)


def register_lm_eval(name: str = MODEL_NAME) -> str:
    """Register `OasisLM` with lm-eval under `name` (idempotent); returns the name."""
    from lm_eval.api.registry import register_model

    register_model(name)(OasisLM)
    return name


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``oasis`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    register_lm_eval()
    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
