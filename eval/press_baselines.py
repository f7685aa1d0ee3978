"""kvpress baselines for the accuracy suite, run as kvpress runs them, at OasisKV's KV size.

`PressLM` is the lm-eval model of `eval.accuracy`'s press rows: a kvpress press compresses each prompt's KV during
its own prefill (kvpress compresses one prompt at a time), then the compressed caches of a request batch that kept
the same number of tokens are decoded greedily together (`greedy_continue` over `stack_caches`: each step a CUDA
graph replay on CUDA, eager elsewhere; every row gets the tokens it gets alone, tested). It takes

- ``press``: a kvpress press written as its constructor call, e.g. ``SnapKVPress``,
  ``AdaKVPress(SnapKVPress())`` or ``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))`` (kvpress's benchmark
  registry runs expected attention that way); literal arguments only.
- ``protocol``: which part of the prompt the press sees. The suite's prompts end with a question line and the
  answer cue ``Answer:``.
  - ``query-agnostic`` (kvpress's default): the context is compressed; the question and the cue are prefilled
    uncompressed after it. This is ``KVPressTextGenerationPipeline(context, question=..., answer_prefix="Answer:")``
    token for token: the rows answer as kvpress's pipeline does (tested, SnapKV and AdaKV expected attention).
  - ``query-aware`` (``query_aware=True`` in kvpress's evaluation): context and question are compressed; the cue
    follows uncompressed. kvpress's evaluation appends the question to the context and prefills ``"\n" +
    answer_prefix``; here the newline before the cue is compressed with the question, one token's difference.
  - ``whole-prompt``: everything is compressed, cue included. This is not a kvpress protocol; it is kept to compare
    with results that ran that way.

The uncompressed tail counts inside the budget: the press keeps ``budget - tail`` tokens per layer and KV head, so
the cache holds ``budget`` tokens per layer and KV head when decoding starts, as OasisKV holds ``budget`` on the GPU.
Head-wise presses (AdaKV) keep that many on average over a layer's heads; kvpress masks the pruned keys rather than
freeing them, so their real memory stays the prompt's (the accuracy tables count the budget). Their rows decode
eagerly, through kvpress's own masking: it searches for its fake key with a data-dependent loop, which a CUDA graph
cannot hold. Each prompt's cache is compacted right after its prefill (`compact_headwise`: per KV head the slots it
attends to, in order; the slots that pad a head to the longest stay masked), so a batch's caches stack
(`stack_headwise`) and decode together; the tokens are those of decoding each uncompacted cache alone (tested).

Press rows run on SDPA, whatever attention earlier rows switched the shared model to: kvpress wraps the attention
functions registered when it is imported, and its head-wise masking lives in that wrapper.

kvpress 0.5.5 needs a transformers that passes ``past_key_values`` to attention modules (5.17; 5.18+ renamed it):
`make_press` says so instead of letting a row run dense under a press's name.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import itertools

import torch
from transformers import DynamicCache

from eval.static_decode import greedy_continue, stack_caches
from oasis_hf import compat
from oasis_hf.errors import UnsupportedError
from oasis_hf.integrations.lm_eval import OasisLM

PROTOCOLS = ("query-agnostic", "query-aware", "whole-prompt")
#: The answer cue every suite prompt ends with (``eval.tasks.ruler``); the question is the line before it.
CUE = "Answer:"
#: Tokens at the prompt's end that `question_split` decodes first (the suite's question and cue take under 100).
TAIL_TOKENS = 512


def make_press(spec: str, model):
    """The kvpress press that `spec` constructs (``SnapKVPress``, ``AdaKVPress(SnapKVPress())``, ...), checked to hook
    this transformers; its compression ratio is set per request."""
    try:
        import kvpress
    except ImportError as exc:
        raise UnsupportedError(f"press={spec!r} needs kvpress (pip install kvpress)") from exc
    from transformers.models.llama.modeling_llama import LlamaAttention

    if "past_key_values" not in inspect.signature(LlamaAttention.forward).parameters:
        import transformers

        raise UnsupportedError(
            f"kvpress reads `past_key_values` from the attention modules' arguments, which transformers "
            f"{transformers.__version__} passes as `cache`: run the kvpress baselines with transformers 5.17 "
            "(kvpress 0.5.5 declares transformers<5.3)"
        )
    choices = sorted(n for n in dir(kvpress) if n.endswith("Press"))

    def build(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return -node.operand.value
        name = node.func if isinstance(node, ast.Call) else node
        if not isinstance(name, ast.Name) or not name.id.endswith("Press") or not hasattr(kvpress, name.id):
            raise UnsupportedError(f"press {spec!r}: {ast.unparse(node)!r} is not a kvpress press or a literal; "
                                   f"presses: {choices}")
        if not isinstance(node, ast.Call):
            return getattr(kvpress, name.id)()
        return getattr(kvpress, name.id)(*map(build, node.args), **{k.arg: build(k.value) for k in node.keywords})

    try:
        tree = ast.parse(spec, mode="eval").body
    except SyntaxError as exc:
        raise UnsupportedError(f"press {spec!r} is not a press constructor call such as AdaKVPress(SnapKVPress())") \
            from exc
    return build(tree)


def question_split(tokenizer, ids: list[int]) -> tuple[int, int]:
    """Token indices ``(question_start, cue_start)`` of a suite prompt `ids`: where its question line and its final
    answer cue begin (a token that straddles a boundary belongs to the part after it). Only the prompt's end is
    decoded (the last `TAIL_TOKENS`, or all of it when the question line starts earlier)."""
    for skip in (max(0, len(ids) - TAIL_TOKENS), 0):
        pieces = tokenizer.batch_decode([[i] for i in ids[skip:]])
        text = "".join(pieces)
        cue = text.rfind(CUE)
        newline = text.rfind("\n", 0, cue) if cue >= 0 else -1
        question = text.rfind("\n", 0, newline) + 1 if newline >= 0 else -1
        if question > 0 or (question == 0 and skip == 0):
            break
    else:
        raise UnsupportedError(f"the prompt has no question line followed by the answer cue {CUE!r}: the press "
                               "protocols need the suite's prompt layout; use protocol='whole-prompt'")
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    return (skip + next(i for i, end in enumerate(ends) if end > question),
            skip + next(i for i, end in enumerate(ends) if end > cue))


def press_ratio(keep: int, num_tokens: int) -> float:
    """The kvpress ``compression_ratio`` that keeps `keep` of `num_tokens` tokens (all of them if fewer): kvpress keeps
    ``int(n * (1 - ratio))``, so aim half a token above `keep` and let the rounding land on it."""
    return max(0.0, 1.0 - (keep + 0.5) / num_tokens)


def kept_tokens(model, cache: DynamicCache) -> set[int]:
    """Tokens per layer and KV head the cache holds for attention, on average over a layer's heads: its length less
    the keys a head-wise press masked (kvpress's AdaKV keeps them in memory but never attends to them)."""
    kept = set()
    for layer, module in zip(cache.layers, attention_modules(model), strict=True):
        batch, heads, length, _ = layer.keys.shape
        masked = getattr(module, "masked_key_indices", None)
        kept.add(length - (0 if masked is None else len(masked[0]) // (batch * heads)))
    return kept


def press_prefill(model, ids: torch.Tensor, press, budget: int, tail: int = 0) -> tuple[DynamicCache, torch.Tensor]:
    """The prompt `ids` (1, n) into a `DynamicCache`: its first ``n - tail`` tokens compressed by `press` to
    ``budget - tail`` tokens per layer and KV head, then the last `tail` prefilled after them uncompressed, at the
    full prompt's rotary positions (kvpress's pipeline places its question so). Returns the cache and the last
    logits (1, vocab)."""
    if tail >= budget:
        raise UnsupportedError(f"the uncompressed tail ({tail} tokens) does not fit in the budget ({budget}): the "
                               "press would have nothing left to keep")
    cache, last = DynamicCache(), compat.last_logits_only(model)
    head = ids[:, : ids.shape[1] - tail]
    press.compression_ratio = press_ratio(budget - tail, head.shape[1])
    with on_sdpa(model), press(model), cache_positions(model):
        out = model(input_ids=head, past_key_values=cache, use_cache=True, **last)
    if tail:
        positions = torch.arange(head.shape[1], ids.shape[1], device=ids.device)[None]
        with on_sdpa(model):
            try:
                out = model(input_ids=ids[:, head.shape[1]:], past_key_values=cache, position_ids=positions,
                            use_cache=True, **last)
            except ValueError as err:  # kvpress's attention_patch.search_hyperplane gave up
                if "fake keys" not in str(err):
                    raise
                raise UnsupportedError(
                    f"the press prunes keys per head, which kvpress hides behind a fake key that every query scores "
                    f"negatively, and it found none for the {tail} uncompressed tokens after the compressed part "
                    f"({err}); use protocol='query-aware' (only the answer cue stays uncompressed) or a press that "
                    "keeps the same tokens in every head") from err
    expected = min(budget, ids.shape[1])
    if kept_tokens(model, cache) != {expected}:
        raise RuntimeError(f"the press left {sorted(kept_tokens(model, cache))} tokens per layer and head, not the "
                           f"budget {expected}")
    return cache, out.logits[:, -1]


class PressLM(OasisLM):
    """lm-eval model: each prompt compressed by a kvpress press under `protocol`, a batch decoded greedily."""

    def __init__(self, pretrained, press: str, protocol: str = "query-agnostic", budget: int = 2048,
                 graphs: bool = False, **kwargs) -> None:
        if protocol not in PROTOCOLS:
            raise UnsupportedError(f"protocol={protocol!r}; choose one of {PROTOCOLS}")
        # OasisLM validates an OasisConfig even for dense rows; blocks of 16 make any budget from 112 tokens valid.
        kwargs.setdefault("block_size", 16)
        super().__init__(pretrained, budget=budget, dense=True, graphs=graphs, **kwargs)
        self.press_spec, self.protocol = press, protocol
        self.press = make_press(press, self.model)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """A request batch (B, n), left padded as lm-eval gives it (`attention_mask`): each prompt compressed on its
        own, then the compressed caches decoded together where they stack (`_decode`);
        returns (B, n + m), finished rows padded."""
        if bool(generation_kwargs.get("do_sample")) and float(generation_kwargs.get("temperature") or 0.0) > 0:
            raise UnsupportedError("the press rows decode greedily; set do_sample=False")
        prompts = unpadded(context, generation_kwargs.get("attention_mask"))
        max_new = max(1, max_length - context.shape[1]) - 1
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id  # what a row that stopped early is filled with, in decoding and after
        pad = pad if pad is not None else (eos if isinstance(eos, int) else eos[0])
        rows: list[torch.Tensor | None] = [None] * len(prompts)
        alike: dict[int, list] = {}  # kept tokens -> (row, cache, first token): these caches stack as they are
        masked = []  # (row, compacted head-wise cache, first token): these stack padded, their padding masked
        try:
            for row, ids in enumerate(prompts):
                tail = 0
                if self.protocol != "whole-prompt":
                    question, cue = question_split(self.tokenizer, ids[0].tolist())
                    tail = ids.shape[1] - (question if self.protocol == "query-agnostic" else cue)
                cache, logits = press_prefill(self.model, ids, self.press, self.budget, tail)
                first = logits.argmax(-1, keepdim=True)
                if head_wise(self.model):  # its masks live on the modules until the next prefill: taken out now
                    masked.append((row, compact_headwise(self.model, cache), first))
                else:  # every prompt longer than the budget keeps exactly the budget
                    alike.setdefault(cache.layers[0].keys.shape[-2], []).append((row, cache, first))
            for group in alike.values():
                self._decode(stack_caches([item[1] for item in group]), group, prompts, rows, max_new, eos, pad)
            if masked:
                cache, padding = stack_headwise([item[1] for item in masked])
                self._decode(cache, masked, prompts, rows, max_new, eos, pad, padding)
        finally:  # no head-wise mask outlives the batch (the next row on this model may be any method)
            for module in attention_modules(self.model):
                module.masked_key_indices = None
        width = max(len(tokens) for tokens in rows)
        new = torch.full((len(rows), width), pad, dtype=context.dtype, device=context.device)
        for row, tokens in enumerate(rows):
            new[row, : len(tokens)] = tokens
        return torch.cat([context, new], dim=1)

    def _decode(self, cache: DynamicCache, items: list, prompts: list[torch.Tensor], rows: list, max_new: int, eos,
                pad: int, padding: list | None = None) -> None:
        """Greedy-decode the stacked `cache` of `items` ((row, cache, first token) each), writing each row's tokens
        into `rows`. With `padding` (per layer, kvpress's ``masked_key_indices`` of a `stack_headwise` batch) the
        slots named there are masked by kvpress's patch, eagerly; otherwise each step is a CUDA graph where
        ``graphs`` allows."""
        if padding is not None:
            for module, indices in zip(attention_modules(self.model), padding, strict=True):
                module.masked_key_indices = indices if len(indices[0]) else None
        with on_sdpa(self.model):
            out = greedy_continue(self.model, cache, torch.cat([item[2] for item in items]),
                                  position=[prompts[item[0]].shape[1] for item in items], max_new_tokens=max_new,
                                  eos_token_id=eos, graphs=self.graphs and padding is None, pad_token_id=pad)
        for (row, _, _), tokens in zip(items, out, strict=True):
            rows[row] = tokens


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules in layer order (where kvpress's hooks and head-wise masks live)."""
    return [module for name, module in model.named_modules() if name.endswith("self_attn")]


def compact_headwise(model, cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A head-wise press's single-prompt `cache` without the keys kvpress masked (AdaKV leaves them in memory and
    masks them at every decode step): per layer and KV head the slots it attends to, in order, the heads padded to
    the longest with slots that `stack_headwise` keeps masked. Returns per layer (keys, values, padding): (1, H, m,
    D), (1, H, m, D) and (H, m) bool, True on padding; clears the masks from the attention modules."""
    layers = []
    for layer, module in zip(cache.layers, attention_modules(model), strict=True):
        keys, values = layer.keys, layer.values
        if keys.shape[0] != 1:
            raise UnsupportedError(f"compact_headwise takes one prompt's cache, got batch {keys.shape[0]}")
        heads, length = keys.shape[1], keys.shape[2]
        keep = torch.ones(heads, length, dtype=torch.bool, device=keys.device)
        indices = getattr(module, "masked_key_indices", None)
        if indices is not None:
            keep[indices[1].to(keys.device), indices[2].to(keys.device)] = False
        counts = keep.sum(1)
        width = int(counts.max())
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]  # attended slots first
        gather = order[None, :, :, None].expand(1, heads, width, keys.shape[-1])
        padding = torch.arange(width, device=keys.device)[None] >= counts[:, None]
        layers.append((keys.gather(2, gather), values.gather(2, gather), padding))
        module.masked_key_indices = None
    return layers


def stack_headwise(items: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]) -> tuple[DynamicCache, list]:
    """One `DynamicCache` of batch ``len(items)`` from `compact_headwise` results, every layer and row padded to the
    longest (zeros, masked); returns it and, per layer, the padding as kvpress's ``masked_key_indices``
    ``(batch, head, slot)``."""
    width = max(keys.shape[2] for layers in items for keys, _, _ in layers)
    stacked, masks = DynamicCache(), []
    for index in range(len(items[0])):
        keys, values, padding = [], [], []
        for layers in items:
            k, v, pad = layers[index]
            extra = width - k.shape[2]
            keys.append(torch.nn.functional.pad(k, (0, 0, 0, extra)))
            values.append(torch.nn.functional.pad(v, (0, 0, 0, extra)))
            padding.append(torch.nn.functional.pad(pad, (0, extra), value=True))
        stacked.update(torch.cat(keys), torch.cat(values), index)
        masks.append(tuple(torch.stack(padding).nonzero(as_tuple=True)))
    return stacked, masks


def unpadded(context: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The prompts of a left-padded batch `context` (B, n) without their padding, each (1, n_i)."""
    if attention_mask is None:
        return [context[row : row + 1] for row in range(context.shape[0])]
    prompts = []
    for row in range(context.shape[0]):
        real = attention_mask[row].nonzero()
        start = int(real[0]) if len(real) else context.shape[1]
        if len(real) != context.shape[1] - start:
            raise UnsupportedError("the press rows take left-padded batches (padding only before each prompt); got "
                                   f"a mask with gaps in row {row}")
        prompts.append(context[row : row + 1, start:])
    return prompts


def head_wise(model) -> bool:
    """Whether the last prefill left a head-wise press's pruned keys on the model's attention modules (kvpress's
    AdaKV records them as ``masked_key_indices`` and masks them in its attention wrapper)."""
    return any(getattr(module, "masked_key_indices", None) is not None for module in model.modules())


@contextlib.contextmanager
def on_sdpa(model):
    """The model on transformers' SDPA attention (which kvpress wrapped at import) while the block runs."""
    config = compat.text_config(model.config)
    previous = config._attn_implementation
    multimodal = config is not model.config
    if previous != "sdpa":
        model.set_attn_implementation({"text_config": "sdpa"} if multimodal else "sdpa")
    try:
        yield
    finally:
        if previous != "sdpa":
            model.set_attn_implementation({"text_config": previous} if multimodal else previous)


@contextlib.contextmanager
def cache_positions(model):
    """While a press is active: give every attention module the ``cache_position`` keyword (the positions of this
    forward's tokens in its cache) that kvpress 0.5.5's hooks read to tell prefill from decoding, and that
    transformers 5.x no longer passes. Forward pre-hooks on the attention modules, removed on exit."""

    def add_positions(module, args, kwargs):
        if "cache_position" not in kwargs:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cache = kwargs.get("past_key_values")
            past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
            kwargs["cache_position"] = torch.arange(past, past + hidden.shape[1], device=hidden.device)
        return args, kwargs

    handles = [module.register_forward_pre_hook(add_positions, with_kwargs=True)
               for module in attention_modules(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
