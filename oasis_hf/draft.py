"""The draft model's side of `speculative_generate`: prefill, one-token steps and rewinds.

A draft model is small, so at decode time its forward costs what launching its kernels from Python costs (a 24-layer
0.5B model: some 300 launches a token), not what its arithmetic costs; drafting ``k`` tokens a round then costs about
``k`` target steps and speculative decoding cannot win. `GraphedDraft` keeps the draft's K/V in fixed-size buffers
(a small `Cache` of its own: the write position and the real-token counts are device tensors) and captures its
one-token forward in a CUDA graph, so each draft token is one replay. `EagerDraft` is the same interface over a
`DynamicCache` (CPU, drafts with sliding-window layers, or ``draft_cuda_graphs=False``).

Masks: the captured step passes transformers a 4-D boolean mask it builds itself (a key is visible when it is a real
token at or before the new position), which transformers uses as given; the prefill passes the 2-D padding mask as
`generate` would. Positions are the count of real tokens before each token, as in `speculative_generate`.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from oasis_hf import compat
from oasis_hf.cache.capture import capture_graph

logger = logging.getLogger(__name__)


PREFILL_MASK_ELEMS = 1 << 27  # at most 128 Mi entries of the (B, 1, chunk, keys) mask transformers builds per chunk


def prefill_chunks(batch: int, num_tokens: int, num_keys: int) -> list[tuple[int, int]]:
    """Query ranges ``[start, end)`` that split a draft prefill of `num_tokens` tokens against up to `num_keys` keys
    so that the 4-D mask transformers builds for SDPA, ``(batch, 1, end - start, num_keys)``, stays under
    `PREFILL_MASK_ELEMS` entries (SDPA also turns a boolean mask into an additive one in the activations' dtype).
    Unchunked, a left-padded batch of 8 x 30k tokens built a boolean mask of 7.2 GB (by its size)
    and asked for 13.4 GiB more (the H200's out-of-memory message)."""
    rows = max(1, PREFILL_MASK_ELEMS // max(1, batch * num_keys))
    return [(start, min(num_tokens, start + rows)) for start in range(0, num_tokens, rows)]


def positions(mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(B, T) positions of the last `num_tokens` tokens under the 2-D padding `mask` (B, L)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -num_tokens:]


def forward_logits(model, ids: torch.Tensor, mask: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
    """Float logits (B, T, V) of `ids` (B, T) appended to `cache`, positions from the 2-D padding `mask` (B, L) as
    in generate; with `last_only`, (B, 1, V) and only that position computed (a prefill must not build (B, P, V)
    logits: 39 GiB in bf16 at 8 x 16k tokens and a 152k vocabulary)."""
    extra = compat.last_logits_only(model) if last_only else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask, ids.shape[1]), use_cache=True,
                **{compat.cache_kwarg(model): cache}, **extra)
    return out.logits.float()


class EagerDraft:
    """Draft steps as plain forwards on a `DynamicCache` (the reference behaviour of `GraphedDraft`)."""

    def __init__(self, model, cache=None) -> None:
        self.model = model
        self.cache = cache if cache is not None else DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """Append the prompt `ids` (B, P) whose padding mask is `mask` (B, P): in query chunks (`prefill_chunks`)
        where some sequence is padded; unpadded, one forward (transformers then passes SDPA no mask: ``is_causal``)."""
        num = ids.shape[1]
        chunks = [(0, num)] if bool(mask.all()) else prefill_chunks(ids.shape[0], num, num)
        for start, end in chunks:
            self.feed(ids[:, start:end], mask[:, :end])

    def feed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Append `ids` (B, T); `mask` (B, length + T): the padding mask up to them. Returns last logits (B, V)."""
        return forward_logits(self.model, ids, mask, self.cache, last_only=True)[:, -1]

    def rewind(self, length: int) -> None:
        """Keep the first `length` tokens."""
        compat.crop_to(self.cache, length)


class _FixedLayer(CacheLayerMixin):
    """One layer of `_FixedCache`: K/V buffers (B, H, N, D) written at the cache's device-side position."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: _FixedCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        n = self.owner.max_len
        self.keys = key_states.new_zeros(batch, heads, n, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, n, value_states.shape[-1])
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        index = self.owner.write_index(key_states.shape[2])
        self.keys.index_copy_(2, index, key_states)
        self.values.index_copy_(2, index, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_len, 0

    def get_max_length(self) -> int:
        return self.owner.max_len

    def crop(self, max_length: int) -> None:  # the owner rewinds its position; the buffers stay
        pass


class _FixedCache(Cache):
    """Fixed-size K/V for every layer; the write position is a device tensor, so a step can be a CUDA graph."""

    def __init__(self, num_layers: int, max_len: int, device) -> None:
        self.max_len = max_len
        self.length = 0  # host mirror of `position`
        self.position = torch.zeros((), dtype=torch.long, device=device)  # where the next token is written
        self.ids = torch.arange(max_len, device=device)  # (max_len,) positions
        super().__init__(layers=[_FixedLayer(self) for _ in range(num_layers)])

    def write_index(self, num_tokens: int) -> torch.Tensor:
        return self.position + self.ids[:num_tokens]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class GraphedDraft:
    """Draft steps of one token each as CUDA graph replays over `_FixedCache` (first step eager, second captures).

    Parameters
    ----------
    model : the draft model (full-attention layers and SDPA attention; see `unsupported`).
    batch, max_len : batch size and most tokens a sequence will hold (prompt + new tokens + drafts).
    device : CUDA device of the model.
    """

    def __init__(self, model, batch: int, max_len: int, device) -> None:
        self.model = model
        self.kwarg = compat.cache_kwarg(model)
        config = compat.text_config(model.config)
        self.cache = _FixedCache(config.num_hidden_layers, max_len, device)
        self.real_ok = torch.ones(batch, max_len, dtype=torch.bool, device=device)  # False at left padding
        self.real = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens held per sequence
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=device)  # the captured step's input
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._steps = 0

    @staticmethod
    def unsupported(model) -> str | None:
        """Why the draft cannot run as `GraphedDraft`, or None: its layers must all be full attention (one mask for
        every layer) and its attention SDPA (which takes the 4-D boolean mask as given)."""
        if any(kind != "full_attention" for kind in compat.layer_types(compat.text_config(model.config))):
            return "the draft model has sliding-window layers"
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation != "sdpa":
            return f"the draft model's attention is {implementation!r}, not 'sdpa'"
        return None

    @property
    def length(self) -> int:
        return self.cache.length

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        """The prompt `ids` (B, P) with its padding `mask` (B, P), eagerly (transformers builds the mask), in query
        chunks (`prefill_chunks`: the mask spans all `max_len` keys)."""
        if self.length:
            raise RuntimeError("GraphedDraft.prefill on a non-empty draft cache")
        num = ids.shape[1]
        if num >= self.cache.max_len:
            raise RuntimeError(f"GraphedDraft: a {num}-token prompt does not fit max_len={self.cache.max_len}")
        self.real_ok[:, :num] = mask.bool()
        full = torch.ones_like(self.real_ok, dtype=mask.dtype)
        full[:, :num] = mask
        where = positions(mask, num)
        for start, end in prefill_chunks(ids.shape[0], num, self.cache.max_len):
            self.model(input_ids=ids[:, start:end], attention_mask=full, position_ids=where[:, start:end],
                       use_cache=True, **{self.kwarg: self.cache}, **compat.last_logits_only(self.model))
            self._advance(end - start, mask[:, start:end].long().sum(-1))

    def feed(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append `ids` (B, T) one token at a time (all real tokens); returns the last logits (B, V)."""
        logits = None
        for t in range(ids.shape[1]):
            self.token.copy_(ids[:, t : t + 1])
            logits = self._step()
        return logits

    def rewind(self, length: int) -> None:
        """Keep the first `length` tokens (the later ones are overwritten by the next steps, never read)."""
        drop = self.length - length
        if drop > 0:
            self._advance(-drop, -drop)

    def _advance(self, num: int, real) -> None:
        self.cache.length += num
        self.cache.position.add_(num)
        self.real.add_(real)

    def _forward_one(self) -> torch.Tensor:
        """The step: mask and positions from device state, one-token forward, counters advanced; (B, V) float."""
        visible = self.real_ok & (self.cache.ids <= self.cache.position)  # (B, N): real and not in the future
        out = self.model(input_ids=self.token, attention_mask=visible[:, None, None, :],
                         position_ids=self.real[:, None], use_cache=True, logits_to_keep=1,
                         **{self.kwarg: self.cache})
        self.cache.position.add_(1)
        self.real.add_(1)
        return out.logits[:, -1].float()

    def _step(self) -> torch.Tensor:
        if self.length >= self.cache.max_len:
            raise RuntimeError(
                f"GraphedDraft holds {self.cache.max_len} tokens per sequence and is full; create it with a larger "
                "max_len (prompt + new tokens + drafts + 1)"
            )
        self._steps += 1
        if not self.token.is_cuda or self._steps == 1:  # first step eager: workspaces and kernels exist before capture
            logits = self._forward_one()
        else:
            if self.graph is None:  # capture records the step without running it; the replay below runs it
                self.graph, self.logits = capture_graph(torch.cuda.Stream(self.token.device), self._forward_one,
                                                        what="draft step")
            self.graph.replay()
            logits = self.logits.clone()
        self.cache.length += 1  # after the forward: during it, the cache holds the tokens before the new one
        return logits


def make_draft(model, batch: int, max_len: int, device, cuda_graphs: bool, cache=None):
    """`GraphedDraft` when it applies (CUDA, no explicit `cache`, full-attention draft, ``cuda_graphs``), else
    `EagerDraft`; the reason is logged once when graphs were asked for and cannot be used."""
    if cache is None and cuda_graphs and torch.device(device).type == "cuda":
        reason = GraphedDraft.unsupported(model)
        if reason is None:
            return GraphedDraft(model, batch, max_len, device)
        logger.info("%s: its draft steps run eagerly on a DynamicCache (no CUDA graph)", reason)
    return EagerDraft(model, cache)
