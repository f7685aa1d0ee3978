"""`OasisCache`: a `transformers.Cache` whose full-attention layers keep their KV in host memory.

Full-attention layers become `OasisLayer`s; sliding-window layers (Gemma3, Qwen2 with sliding layers) stay on
transformers' `DynamicSlidingWindowLayer` (already bounded by the window; `WindowLayer` marks its keys). Any other
layer type raises.

Stream ordering (CUDA):

- write-back: the new tokens' K/V are written to the pinned host store by a zero-copy kernel on a side stream that
  first waits for the current stream (the K/V exist); the source tensors are kept alive with ``record_stream`` and
  an event marks completion per layer;
- fetch: before a layer gathers blocks from host, the current stream waits for that layer's write-back event, so a
  block is never read before it is written.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref

import torch
from transformers.cache_utils import Cache
from transformers.configuration_utils import PretrainedConfig

from oasis_hf import compat
from oasis_hf.cache.host_store import BlockStore, HostKVStore
from oasis_hf.cache.layer import OasisLayer, WindowLayer
from oasis_hf.cache.pinned import PinnedPool
from oasis_hf.cache.prefill import padding_starts
from oasis_hf.cache.runtime import DeviceRuntime, close_all
from oasis_hf.cache.stats import OasisStats
from oasis_hf.config import OasisConfig
from oasis_hf.errors import OasisError, UnsupportedError
from oasis_hf.selectors import get_selector

logger = logging.getLogger(__name__)


class OasisCache(Cache):
    """KV cache with the full KV in host memory and at most ``budget_tokens`` per sequence and layer on the GPU
    (`OasisConfig.layer_budget_tokens` gives single layers budgets of their own).

    Parameters
    ----------
    model_config : the model's `PretrainedConfig` (multimodal configs use their text config).
    config : `OasisConfig`; keyword `overrides` replace its fields (``OasisCache(cfg, budget_tokens=1024)``).
    host_pool : a `PinnedPool` shared by caches created one after another (a cache per request batch): the host
        store reuses its page-locked buffers instead of pinning new memory, and `close` returns them (the closed
        cache then refuses further use). None: the store owns its memory.

    Examples
    --------
    >>> import oasis_hf
    >>> oasis_hf.enable(model)                      # registers "oasis" attention and switches the model to it
    >>> cache = oasis_hf.OasisCache(model.config, oasis_hf.OasisConfig(budget_tokens=2048))
    >>> out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256)

    A cache holds one batch of sequences. For the next batch, call ``cache.reset()`` (it keeps the allocations and
    captured graphs: the next call of the same batch size starts without allocating or capturing) or make a new one.
    """

    def __init__(self, model_config, config: OasisConfig | None = None, *, host_pool: PinnedPool | None = None,
                 **overrides) -> None:
        if not isinstance(model_config, PretrainedConfig):
            hint = (" (pass model.config)" if isinstance(getattr(model_config, "config", None), PretrainedConfig)
                    else "")
            raise TypeError(f"OasisCache takes the model's config, a transformers PretrainedConfig, as its first "
                            f"argument; got {type(model_config).__name__}{hint}")
        if config is not None and not isinstance(config, OasisConfig):
            raise TypeError(f"OasisCache's config must be an OasisConfig (or None for the defaults), got "
                            f"{type(config).__name__}; keyword overrides go directly: "
                            "OasisCache(model.config, budget_tokens=1024)")
        config = config or OasisConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        text_config = compat.text_config(model_config)
        layers = []
        for idx, kind in enumerate(compat.layer_types(text_config)):
            if kind == "full_attention":
                layers.append(OasisLayer(self, idx))
            elif kind == "sliding_attention":
                layers.append(compat.sliding_window_layer(text_config.sliding_window, WindowLayer))
            else:
                raise UnsupportedError(
                    f"layer {idx} has type {kind!r}; OasisCache handles 'full_attention' and 'sliding_attention' "
                    "layers only (use DynamicCache for this model)"
                )
        if not any(isinstance(layer, OasisLayer) for layer in layers):
            raise UnsupportedError("the model has no full-attention layer for OasisCache to manage; use DynamicCache")
        managed = [idx for idx, layer in enumerate(layers) if isinstance(layer, OasisLayer)]
        unknown = [idx for idx, _ in config.layer_budget_tokens or () if idx not in managed]
        if unknown:
            raise UnsupportedError(
                f"OasisConfig.layer_budget_tokens names layer(s) {unknown}, which this model's cache does not manage: "
                f"its full-attention layers are {managed} (sliding-window layers keep their window)"
            )
        self.selector = get_selector(config.selector)
        self.host: BlockStore | None = None  # HostKVStore, or a RemoteBlockStore after oasis_hf.remote.attach
        self.host_pool = host_pool
        self._host_returned = False  # closed with a pool: the host memory went back to it
        self.stats = OasisStats()
        self.stats.drain = weakref.WeakMethod(self.wait)
        self._runtimes: dict[torch.device, DeviceRuntime] = {}  # per device: prefetch worker, side streams
        self.step_runner = None  # the `oasis_hf.DecodeGraph` whose forward is running (layers take its path)
        #: True while that forward is a compiled model's: traced updates defer to the attention's operator
        #: (`oasis_hf.cache.step_op`).
        self.compiled_step = False
        self._starts: tuple | None = None  # (mask, length, device, result) of the last prefill: see `padding_starts`
        #: The `oasis_hf.DecodeGraph` that ``model.generate``'s decode forwards replay over this cache (created by the
        #: fast path `oasis_hf.enable` installs, on the first decode forward; None until then or when not used).
        self.graph_runner = None
        self._epoch = 0  # bumped whenever the tables and host segments are reallocated (graphs of them are stale)
        self._closed = False  # close() is terminal
        self._planned_tokens = 0  # the longest sequence the running generate call can reach (`plan_tokens`)
        self._last_output: torch.Tensor | None = None  # the last generate call's tokens (`note_output`)
        self._thread: int | None = None  # the thread that feeds this cache (set by its first forward)
        # (KV heads, head dim) every layer's K/V must have: what the model this cache was built for gives.
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        self._kv_shape = (heads, head_dim)
        self._checked: set[int] = set()  # layers whose K/V shape was checked
        # No thread outlives the cache: close the workers when the cache is collected (or at interpreter exit).
        self._finalizer = weakref.finalize(self, close_all, self._runtimes)
        super().__init__(layers=layers)
        self._oasis_layers = [layer for layer in layers if isinstance(layer, OasisLayer)]

    # ------------------------------------------------------------------------------------------------ layers
    @property
    def oasis_layers(self) -> list[OasisLayer]:
        """The managed (full-attention) layers, in model order."""
        return self._oasis_layers

    @property
    def in_whole_step(self) -> bool:
        """Whether a `oasis_hf.DecodeGraph` forward over this cache is running (its layers take the whole-step path)."""
        return self.step_runner is not None

    @property
    def table_epoch(self) -> int:
        """A counter bumped whenever the tables and host segments are reallocated (graphs captured before are
        stale)."""
        return self._epoch

    @property
    def host_capacity_blocks(self) -> int:
        return self.host.capacity_blocks if self.host is not None else 0

    def reserve(self, num_tokens: int) -> None:
        """Make the host store (all layers at once) and the block maps hold `num_tokens` tokens per sequence."""
        if self._host_returned:
            raise UnsupportedError(
                "this OasisCache was closed and its host memory returned to its host_pool (another cache may use it "
                "now); use a fresh OasisCache for the next batch"
            )
        if self.host is None:
            first = next(layer for layer in self.oasis_layers if layer.is_initialized)
            cfg = self.config
            pin = cfg.pin_host_memory if cfg.pin_host_memory is not None else torch.cuda.is_available()
            self.host = HostKVStore(
                [layer.layer_idx for layer in self.oasis_layers],
                first.batch_size, first.num_kv_heads, first.head_dim, cfg.block_size, first.dtype,
                pin=pin, headroom_bytes=cfg.host_memory_headroom_bytes, growth_tokens=cfg.host_growth_tokens,
                limit_bytes=cfg.host_memory_limit_bytes, pool=self.host_pool,
            )  # fmt: skip
        if self.config.blocks(num_tokens) > self.host.capacity_blocks:
            self.wait()  # growing replaces the block maps that outstanding selection jobs still update
        reserve = max(self.config.host_capacity_tokens or 0, self._planned_tokens)
        if self.host.ensure_capacity(num_tokens, reserve_tokens=reserve):
            self._epoch += 1
            for layer in self.oasis_layers:
                layer.grow(self.host.capacity_blocks)

    def plan_tokens(self, num_tokens: int) -> None:
        """The sequences may reach `num_tokens` tokens (prompt plus new tokens; `oasis_hf.enable`'s generate does
        this): the host store is sized for all of it at the first forward, which refuses with `HostMemoryError` (the
        longest length that fits named) before any decoding, instead of failing when the store grows mid-decode."""
        self._planned_tokens = max(self._planned_tokens, int(num_tokens))

    def runtime(self, device: torch.device) -> DeviceRuntime:
        """What this cache runs on `device`: its prefetch worker and side streams (`DeviceRuntime`)."""
        device = torch.device(device)
        runtime = self._runtimes.get(device)
        if runtime is None:
            runtime = self._runtimes[device] = DeviceRuntime(device)
        return runtime

    @property
    def runtimes(self) -> dict[torch.device, DeviceRuntime]:
        """The devices this cache has run on so far, and their runtimes (read-only view)."""
        return dict(self._runtimes)

    def wait(self) -> None:
        """Wait for every outstanding selection job (re-raises a worker failure as `PrefetchError`)."""
        for layer in self._oasis_layers:
            layer.jobs.await_job()

    def close(self) -> None:
        """Finish outstanding selection jobs and stop the prefetch workers (idempotent; `reset` keeps them). Terminal:
        a closed cache refuses further forwards."""
        self._closed = True
        try:
            self.wait()
        finally:
            close_all(self._runtimes)
            if self.host is not None:
                # A remote store frees the request's objects; the local one keeps its memory, or returns it to its
                # pool, after which this cache refuses further use (its captured graphs point into that memory).
                self.host.close()
                if self.host_pool is not None and getattr(self.host, "pool", None) is self.host_pool:
                    self._host_returned = True
                    self._epoch += 1

    def __enter__(self) -> OasisCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def graph_pool(self, device: torch.device, kind: str):
        """The private memory pool the layers' graphs of `kind` on `device` share: ``"step"`` graphs replay one
        after another on the compute stream, ``"job"`` graphs one after another on the prefetch stream; the two
        kinds run concurrently, so they never share.

        Taken from a live graph: once every graph of a pool is gone (after `grow` or `reset`) the allocator retires
        the pool, so a new one is started then.
        """
        for layer in self._oasis_layers:
            pool = layer.graph_pool(device, kind)
            if pool is not None:
                return pool
        return torch.cuda.graph_pool_handle()

    def write_back(self, layer: OasisLayer, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        host = self.host
        if (keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype) != (
            host.batch_size, host.num_kv_heads, host.head_dim, host.dtype
        ):
            raise UnsupportedError(
                f"layer {layer.layer_idx} K/V {tuple(keys.shape)} {keys.dtype} differ from the other layers' "
                f"({host.batch_size}, {host.num_kv_heads}, *, {host.head_dim}) {host.dtype}; OasisCache needs one "
                "KV shape across full-attention layers"
            )
        if not (keys.is_cuda and host.pin):
            host.write(layer.layer_idx, keys, values, start)
            return
        device = keys.device
        stream = self.runtime(device).writeback_stream
        stream.wait_stream(torch.cuda.current_stream(device))  # K/V of this step exist before we read them
        with torch.cuda.device(device), torch.cuda.stream(stream):
            host.write(layer.layer_idx, keys, values, start)
            event = torch.cuda.Event()
            event.record(stream)
        keys.record_stream(stream)  # keep the sources alive until the copy ran
        values.record_stream(stream)
        layer.writeback_event = event

    # ------------------------------------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' entry point, per layer and forward; refuses misuse before any state changes: a closed
        cache, a second thread, a model other than the one the cache was built for, a cache left mid-forward.

        Traced inside a compiled whole-step forward (while `compiled_step`), it returns the K/V as they are: the
        attention's operator makes this call when the compiled forward runs (`oasis_hf.cache.step_op`).
        """
        if self.compiled_step and torch.compiler.is_compiling():
            return key_states, value_states
        return self._update(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable  # host state and our kernels: a compiled model breaks its graph here
    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_use(key_states, layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_prompt(self, input_ids: torch.Tensor | None) -> None:
        """Refuse a ``generate`` call over this cache before any forward runs (`oasis_hf.enable`'s generate calls
        it): a closed cache, one owned by another thread, one left mid-forward, or `input_ids` (B, L) that do not
        continue the tokens it holds (no longer than them, or not starting with the last call's output, which
        `note_output` recorded). A cache serves one generation, or its continuation."""
        self._check_state(claim=False)
        held = self.get_seq_length()
        if not held or getattr(input_ids, "ndim", 0) != 2:
            return
        if any(layer.mid_forward for layer in self._oasis_layers):
            self._check_whole()
        previous = self._last_output
        if input_ids.shape[1] <= held:
            why = f"the prompt has {input_ids.shape[1]} tokens, no more than the {held} it holds"
        elif previous is not None and (
            previous.shape[0] != input_ids.shape[0] or previous.shape[1] < held
            or not torch.equal(input_ids[:, :held], previous[:, :held].to(input_ids.device))
        ):
            why = "the prompt does not start with the tokens of its previous generate call"
        else:
            return
        raise UnsupportedError(
            f"this OasisCache already holds {held} tokens per sequence and {why}: a cache serves one generation (or "
            "its continuation from the previous output). Make a fresh OasisCache, or call cache.reset() first"
        )

    def note_output(self, sequences: torch.Tensor) -> None:
        """The (B, L) tokens a generate call over this cache returned: a later call must start with them."""
        self._last_output = sequences

    def _check_state(self, claim: bool = True) -> None:
        if self._closed:
            returned = (" and its host memory returned to its host_pool (another cache may use it now)"
                        if self._host_returned else "")
            raise UnsupportedError(f"this OasisCache was closed{returned}; make a new OasisCache for the next batch")
        thread = threading.get_ident()
        if self._thread is None:
            if claim:
                self._thread = thread
        elif thread != self._thread:
            raise UnsupportedError(
                "this OasisCache is in use by another thread; a cache holds one batch of sequences and is fed by one "
                "thread: make an OasisCache per thread (or call reset() before handing it over)"
            )

    def _check_use(self, key_states: torch.Tensor, layer_idx: int) -> None:
        self._check_state()
        if layer_idx >= len(self.layers):
            raise UnsupportedError(
                f"the model sent layer {layer_idx}, but this OasisCache was built for a config with "
                f"{len(self.layers)} layers; build it from this model's config: OasisCache(model.config, ...)"
            )
        if layer_idx not in self._checked:
            heads, head_dim = key_states.shape[1], key_states.shape[-1]
            # A tensor-parallel rank sends an even share of the config's KV heads.
            if head_dim != self._kv_shape[1] or heads > self._kv_shape[0] or self._kv_shape[0] % heads:
                raise UnsupportedError(
                    f"layer {layer_idx} sent K/V of {heads} KV heads x head dim {head_dim}, but this OasisCache was "
                    f"built for a config with {self._kv_shape[0]} x {self._kv_shape[1]}; build it from this model's "
                    "config: OasisCache(model.config, ...)"
                )
            self._checked.add(layer_idx)
        if layer_idx == 0 and any(layer.is_initialized for layer in self._oasis_layers):
            self._check_whole()

    def _check_whole(self) -> None:
        """At the start of a forward on a cache holding tokens: no managed layer is left between its update and its
        attention or behind the others (an exception or interrupt mid-forward), and every one got the last forward's
        tokens (else the model has fewer layers than the cache's config)."""
        layers = [layer for layer in self._oasis_layers if layer.is_initialized]
        lengths = {layer.length for layer in layers}
        pending = [layer.mid_forward for layer in layers]
        if all(pending) and len(layers) == len(self._oasis_layers) and len(lengths) == 1:
            return  # no attention ran at all: the model is not on the oasis attention, which the layer says next
        if len(lengths) > 1 or any(pending):
            raise OasisError(
                f"this OasisCache was left in the middle of a forward (its layers hold {sorted(lengths)} tokens: an "
                "exception or interrupt stopped it between layers); call cache.reset() to start over, or make a new "
                "OasisCache"
            )
        empty = [layer.layer_idx for layer in self._oasis_layers if not layer.is_initialized]
        if empty:
            raise UnsupportedError(
                f"the previous forward left layers {empty} of this OasisCache empty: the model has fewer layers than "
                "the config the cache was built for; build it from this model's config: OasisCache(model.config, ...)"
            )

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end: ``crop(-n)`` removes ``n`` (5.18+), ``crop(n > 0)`` keeps ``n`` (5.17 legacy).
        transformers' assisted generation may pass a 0-d tensor: the layers' lengths stay Python ints."""
        max_length = int(max_length)
        length = self.get_seq_length()
        remove = max(0, length - max_length) if max_length > 0 else -max_length
        # First, before any layer waits for its job and the worker moves on (crop(0), a no-op, drops nothing).
        if remove and self.config.drop_rejected_drafts:
            for layer in self._oasis_layers:
                layer.drop_rejected(remove)
        for layer in self.layers:
            layer.crop(-remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedError("OasisCache does not support beam search; use greedy or sampling (num_beams=1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise UnsupportedError(
            "OasisCache cannot expand its batch (contrastive search / num_return_sequences on a filled cache); "
            "use a fresh cache per expanded batch"
        )

    def padding_starts(self, attention_mask: torch.Tensor | None, batch: int, length: int,
                       device) -> tuple[torch.Tensor, list[int]]:
        """The first real position of each sequence from the forward's 2-D left-padding mask (None: no padding): a
        (B,) long tensor on `device`, and the same numbers on the host (padding tokens per sequence).

        Every layer of a prefill forward gets the same mask: it is read and checked (one host synchronisation) for
        the first layer only, not once per layer, which would stop the host from queueing ahead of the GPU."""
        memo = self._starts
        if memo is not None and memo[0] is attention_mask and memo[1] == length and memo[2] == device:
            return memo[3]
        starts = padding_starts(attention_mask, batch, length, device)
        self._starts = (attention_mask, length, device, starts)
        return starts

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedError("OasisCache cannot select batch entries; use a fresh cache per batch")

    def reset(self) -> None:
        """Forget every token and keep the allocations, as transformers' ``StaticCache.reset`` does: the block pools,
        tables and summaries on the GPU, a local host store's memory, and the captured graphs (each layer's decode
        step and selection job, and the whole-step graph of `oasis_hf.enable`'s fast path), which address them.
        A next batch of the same size whose length fits the host store then allocates and captures nothing; a
        batch of another size reallocates at its first forward. A cache left mid-forward is usable again (its
        graphs are dropped); the next forward may come from another thread. `close` frees the memory."""
        interrupted = any(layer.mid_forward for layer in self._oasis_layers)
        super().reset()
        self._thread = None
        self._last_output = None
        self._planned_tokens = 0
        self._starts = None
        if self.host is not None and (interrupted or not self.host.reusable):
            self.drop_host_store()  # a remote store's objects belong to the request
        elif interrupted:
            self._epoch += 1

    def relayout(self) -> None:
        """The first forward after `reset` brings a batch of another shape, or runs in another inference mode than
        the buffers were made in (tensors made under ``torch.inference_mode`` refuse in-place writes outside it):
        every layer drops its buffers and graphs, and so do the host store and the whole-step runner (a new table
        epoch). Each layer's ``update`` then allocates for the new batch."""
        self.wait()
        for layer in self._oasis_layers:
            layer.release_buffers()
        self.graph_runner = None
        self.drop_host_store()

    def drop_host_store(self) -> None:
        """Free the host store (or return it to the pool); the next forward makes one for its batch. Every graph
        captured so far is stale (a new table epoch)."""
        self._epoch += 1
        if self.host is not None:
            self.wait()
            self.host.release()
            self.host = None

    # ------------------------------------------------------------------------------------------------ memory
    def device_nbytes(self) -> int:
        """Bytes the managed layers hold on the GPU: block pools + summaries + block tables (sliding layers apart)."""
        return sum(layer.device_nbytes for layer in self.oasis_layers)

    def host_nbytes(self) -> int:
        return self.host.nbytes if self.host is not None else 0

    def dense_nbytes(self) -> int:
        """Bytes a `DynamicCache` would hold for the managed layers at the current length."""
        layers = [layer for layer in self.oasis_layers if layer.is_initialized]
        if not layers:
            return 0
        first = layers[0]
        elem = first.pool_k.element_size()
        per_layer = 2 * first.batch_size * first.num_kv_heads * first.length * first.head_dim * elem
        return per_layer * len(layers)
