"""``model.generate`` without a device synchronisation per step, for the whole-step graph path.

transformers' decoding loop (``_sample``) reads whether every sequence has stopped at the end of each step
(``bool(unfinished_sequences.max() == 0)``): the host waits for the step's GPU work, and the GPU then idles while
the host prepares the next step (``prepare_inputs_for_generation``, the forward's Python, the graph launch). With a
decode step of one CUDA graph replay (`oasis_hf.DecodeGraph`, 2-3 ms on a 1.5B model) that idle time is a large
share of the step. transformers has the fix, ``DeferredStopCheck``: the flag is copied to pinned memory
asynchronously and read one step later, so the next step is queued before the previous one has finished; it costs
one extra forward when an EOS stops every sequence, which is undone (the cache cropped, the token dropped).
transformers applies it on ``mps`` only, and its events do not exist on the CPU: `DeferredStop` is the same check
for any device, so the CPU runs (and the tests check) the same loop.

`install(model)` (called by `oasis_hf.enable`, never at import) wraps ``model.generate`` on the instance: a call
whose cache is an `OasisCache` that takes the graph path (`OasisConfig.whole_step`, `OasisConfig.cuda_graphs`,
`OasisConfig.queued_generate`, a device in `fast_path.GRAPH_DEVICES`) and that uses no draft model, prompt lookup
or ``custom_generate`` of its own decodes with `queued_sample`, transformers' greedy / sampling loop with the
deferred stop check. Tokens, scores, logits processors, stopping criteria, EOS and padding are those of plain
``generate``; a streamer receives every token, one step later. What `queued_sample` does not cover (attention or
hidden-state outputs, ``synced_gpus``, beam search) runs transformers' own decoding method, with one log line
saying why.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GENERATION_MODES_MAPPING

from oasis_hf import compat
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.integrations import fast_path

logger = logging.getLogger(__name__)

_MARK = "_oasis_queued_generate"
_CACHE_KWARGS = ("past_key_values", "cache")
#: ``generate`` arguments that select transformers' assisted decoding (drafts verified by the target).
_ASSISTED = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "assistant_tokenizer")
_STREAMER = "oasis_streamer"


def queued(model, cache, kwargs: dict) -> bool:
    """Whether ``model.generate(**kwargs)`` over `cache` decodes with `queued_sample`."""
    if not isinstance(cache, OasisCache):
        return False
    cfg = cache.config
    if not (cfg.queued_generate and cfg.whole_step and cfg.cuda_graphs):
        return False
    if kwargs.get("custom_generate") is not None or any(kwargs.get(name) is not None for name in _ASSISTED):
        return False
    if kwargs.get("synced_gpus"):
        return False
    return model.device.type in fast_path.GRAPH_DEVICES


def install(model) -> None:
    """Make `model.generate` decode with `queued_sample` where `queued` says so (idempotent)."""
    if getattr(model.generate, _MARK, False):
        return
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        cache = next((kwargs[k] for k in _CACHE_KWARGS if kwargs.get(k) is not None), None)
        if len(args) <= 1 and queued(model, cache, kwargs):
            kwargs["custom_generate"] = queued_sample
            if kwargs.get("streamer") is not None:
                # generate hands a custom decoding method only the arguments its signature adds to _sample's
                # (not the streamer, which it still gives the prompt): the streamer again, under a key of ours.
                kwargs[_STREAMER] = kwargs["streamer"]
        return original(*args, **kwargs)

    setattr(generate, _MARK, True)
    model.generate = generate


class DeferredStop:
    """Whether the loop stops, decided one step late: transformers' ``DeferredStopCheck`` (which needs device
    events, so ``mps`` / CUDA only), for any device. Each step copies its stop flag (and, for a streamer, its tokens)
    into host memory without waiting (pinned memory and an event on CUDA; at once on the CPU) and reads the previous
    step's: the host waits for step ``n - 1`` while step ``n`` runs. A stop seen one step late leaves one extra
    step, which `finish` reports and crops from the cache."""

    def __init__(self, input_ids: torch.Tensor, max_length: int | None, cache, streamer=None) -> None:
        self.max_length, self.cache, self.streamer = max_length, cache, streamer
        cuda = input_ids.device.type == "cuda"
        self.slots = [(torch.zeros((), dtype=torch.bool, pin_memory=cuda),
                       torch.zeros(input_ids.shape[0], dtype=torch.long, pin_memory=cuda),
                       torch.cuda.Event() if cuda else None) for _ in range(2)]
        self.step = 0
        self.stop_seen = False

    def __call__(self, unfinished_sequences: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
        """Record step n's flag and tokens, read step n - 1's; True once the loop should end (after this step)."""
        flag, tokens_host, done = self.slots[self.step % 2]
        flag.copy_(unfinished_sequences.max() == 0, non_blocking=True)
        if self.streamer is not None:
            tokens_host.copy_(tokens, non_blocking=True)
        if done is not None:
            done.record()
        if self.step > 0:
            flag_before, tokens_before, done_before = self.slots[(self.step - 1) % 2]
            if done_before is not None:
                done_before.synchronize()
            if self.streamer is not None:
                self.streamer.put(tokens_before.clone())
            self.stop_seen = bool(flag_before)
        self.step += 1
        return self.stop_seen or (self.max_length is not None and length >= self.max_length)

    def finish(self) -> int:
        """Steps to undo (1 when the stop was seen one step late, else 0), already cropped from the cache; the
        last step's tokens streamed when it is kept."""
        last = self.slots[(self.step - 1) % 2]
        if last[2] is not None:
            last[2].synchronize()
        if self.stop_seen:
            if self.cache is not None:
                self.cache.crop(-1)
            return 1
        if self.streamer is not None and self.step > 0:
            self.streamer.put(last[1].clone())
        return 0


def _standard_reason(model, generation_config, synced_gpus: bool) -> str | None:
    """Why this call runs transformers' own decoding method instead: None when `queued_sample` covers it."""
    mode = generation_config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value}"
    if synced_gpus:
        return "synced_gpus (every rank must run every step)"
    if generation_config.output_attentions or generation_config.output_hidden_states:
        return "attention weights or hidden states requested"
    if model.config.is_encoder_decoder:
        return "an encoder-decoder model"
    return None


def queued_sample(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    oasis_streamer=None,
    **model_kwargs,
):
    """transformers' greedy / multinomial sampling loop with the stop check deferred by one step (a decoding
    method for ``generate(custom_generate=...)``; `install` passes it for `OasisCache` calls on the graph path).

    Parameters are those of ``GenerationMixin._sample``: `input_ids` (B, L) the prompt, `logits_processor` and
    `stopping_criteria` as ``generate`` prepared them, `generation_config`, `streamer`, and the model kwargs
    (attention mask, the cache); `oasis_streamer` is the streamer as `install`'s wrapper passes it (``generate``
    gives a custom decoding method no ``streamer``). Returns the (B, L + N) sequences, or with
    ``return_dict_in_generate`` a ``GenerateDecoderOnlyOutput`` (sequences, scores, logits, the cache): what
    transformers' loop returns.
    """
    streamer = streamer if streamer is not None else oasis_streamer
    reason = _standard_reason(model, generation_config, synced_gpus)
    if reason is not None:
        logger.info("oasis_hf: generate runs transformers' decoding loop (a device sync per step): %s", reason)
        method = GENERATION_MODES_MAPPING[generation_config.get_generation_mode()]
        return getattr(type(model), method)(model, input_ids, logits_processor=logits_processor,
                                            stopping_criteria=stopping_criteria, generation_config=generation_config,
                                            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    pad_token_id = generation_config._pad_token_tensor
    return_dict = generation_config.return_dict_in_generate
    scores = () if (return_dict and generation_config.output_scores) else None
    raw_logits = () if (return_dict and generation_config.output_logits) else None
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished_sequences = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    if pad_token_id is not None:
        pad_token_id = pad_token_id.to(input_ids.device)

    outputs = model._prefill(input_ids, generation_config, model_kwargs,
                             is_first_iteration=not generation_config.is_assistant)
    cache = next((model_kwargs[k] for k in _CACHE_KWARGS if model_kwargs.get(k) is not None), None)
    stop_check = DeferredStop(input_ids, stopping_criteria.max_length, cache, streamer)
    prefill_consumed, finished = False, False
    with model._optimize_model_for_decode():
        while not finished:
            if prefill_consumed:
                model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
                outputs = model(**model_inputs, return_dict=True)
            prefill_consumed = True
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
            next_token_logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            next_token_scores = logits_processor(input_ids, next_token_logits)
            if scores is not None:
                scores += (next_token_scores,)
            if raw_logits is not None:
                raw_logits += (next_token_logits,)
            if generation_config.do_sample:
                probs = nn.functional.softmax(next_token_scores, dim=-1)
                next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
            else:
                next_tokens = torch.argmax(next_token_scores, dim=-1)
            if has_eos_stopping_criteria:  # finished sequences get the padding token
                next_tokens = next_tokens * unfinished_sequences + pad_token_id * (1 - unfinished_sequences)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished_sequences = unfinished_sequences & ~stopping_criteria(input_ids, scores)
            finished = stop_check(unfinished_sequences, next_tokens, input_ids.shape[1])
            del outputs
    if stop_check.finish():  # the extra step: its token, scores and logits go (its K/V already went)
        input_ids = input_ids[:, :-1]
        scores = scores[:-1] if scores is not None else None
        raw_logits = raw_logits[:-1] if raw_logits is not None else None
    if streamer is not None:
        streamer.end()
    if return_dict:
        return compat.decoder_only_output(input_ids, scores, raw_logits, cache)
    return input_ids
