"""`DecodeGraph`: a whole-model decode forward over an `OasisCache` as one CUDA graph per query length ``T``.

With per-layer step graphs (`OasisCache` on CUDA) the attention of a decode step costs a few microseconds of host
time per layer, but the rest of the model (norms, projections, RoPE, MLP, and transformers' Python around them)
still launches eagerly: at batch 8 on an 8B model that is about 20 ms of host time per step, more than the GPU work
of an OasisKV step. `DecodeGraph` captures the whole forward instead: embeddings to logits, every layer's
write-back, decode step and (for ``lookahead`` / ``previous-query``) selection job forked onto the prefetch stream
and joined before the graph ends. A replay costs a few launches: the host copies the inputs (one launch), replays
and copies the logits out. The step's first position lives in a device scalar that every forward advances by its
``T`` at its end, so a run of steps of one ``T`` with nothing in between (plain decoding) never writes it from the
host; after a `OasisCache.crop` or a change of ``T`` (speculative decoding) the host fills it before the replay.
With `OasisConfig.selection_interval` N > 1 a forward forks the selection jobs only every Nth time, and each ``T``
has two graphs, one with the jobs and one without, each warmed up and captured on its own.

It runs our own decode loops (`oasis_hf.speculative_generate(..., target_graphs=True)`, ``eval.bench_decode``),
not ``model.generate``. Requirements, checked with a clear error: every cache layer is an `OasisLayer` (no sliding
window layers), one device, a host store the GPU reads directly (pinned, local), the ``wait`` prefetch policy and no
``measure_recall``. On the CPU (tests) the same per-layer path runs eagerly at every call, never captured.

The first call of a ``T`` (and the first after the host store grew, which reallocates the tables) runs eagerly on
the capture stream, compiling every kernel variant; the next one captures and replays; later ones replay.

With `OasisConfig.compile_model` the forward it captures is the model's, compiled by ``torch.compile`` as one graph
(Inductor fuses the norms, RoPE, activations and residual adds across layers; each layer's cache update and
attention are one opaque operator, `oasis_hf.cache.step_op`). Two
eager calls of each ``T`` come before its capture: the first compiles, the second recompiles what depends on the
step's position (transformers' mask arguments) as dynamic, so that the capture itself compiles nothing. Once a shape
has settled so in the process, a later runner (the next ``generate`` call's cache) captures after one eager call
when that call compiled nothing.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch
import torch._dynamo
import torch._dynamo.utils

from oasis_hf import compat
from oasis_hf.cache import step_op
from oasis_hf.cache.capture import capture_graph
from oasis_hf.cache.layer import OasisLayer
from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.draft import forward_logits, positions
from oasis_hf.errors import UnsupportedError

logger = logging.getLogger(__name__)


#: Per model, the shapes (`DecodeGraph._shape`) whose compiled forward (`OasisConfig.compile_model`) has settled in
#: this process: compiled, recompiled with the step's position dynamic, then captured without compiling. A later
#: runner (the next ``generate`` call's cache) warms such a shape up once instead of twice when that one eager call
#: compiles nothing.
_SETTLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compilations() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # (B, T) static inputs the graph reads
    position_ids: torch.Tensor
    logits: torch.Tensor  # (B, T, V) the graph's output buffer
    epoch: int  # the cache's table epoch it was captured against


def unsupported(cache) -> str | None:
    """Why `DecodeGraph` cannot run decode forwards over `cache`, or None when it can. What depends on the prefill
    (the layers' devices, the host store) is checked once the cache holds tokens."""
    if not isinstance(cache, OasisCache):
        return f"DecodeGraph runs over an OasisCache, got {type(cache).__name__}"
    others = [type(layer).__name__ for layer in cache.layers if not isinstance(layer, OasisLayer)]
    if others:
        return (f"DecodeGraph captures models whose every layer is an OasisLayer; this cache also has {others[0]} "
                "layers (sliding-window attention), which grow by concatenation and cannot be captured; decode with "
                "model(...) (per-layer step graphs) instead")
    cfg = cache.config
    if cfg.prefetch_policy != "wait":
        return (f"DecodeGraph needs prefetch_policy='wait', not {cfg.prefetch_policy!r}: the stale policy decides on "
                "the host, per step, whether a job finished")
    if cfg.measure_recall:
        return ("DecodeGraph cannot measure recall (it synchronises with the host every layer); set "
                "OasisConfig.measure_recall=False or decode with model(...)")
    layers = [layer for layer in cache.oasis_layers if layer.is_initialized]
    if len({layer.device for layer in layers}) > 1:
        return "DecodeGraph captures one device; this model's layers are on several (decode with model(...) instead)"
    if cache.host is not None and not cache.host.capturable_fetch:  # a remote store runs host work per step
        return ("DecodeGraph needs the local host store (its fetch is device work only); a remote tier's store runs "
                "host work per step: decode with model(...) instead")
    return None


class DecodeGraph:
    """Decode forwards of `model` over `cache`, each ``T`` captured once as a CUDA graph.

    Parameters
    ----------
    model : a causal LM switched to the ``oasis`` attention (`oasis_hf.enable`).
    cache : the `OasisCache` the model decodes with; prefill it with an ordinary forward first. Held weakly (a cache
        owns the runner `model.generate` uses, `OasisCache.graph_runner`): keep the cache alive while decoding.

    Call it as ``logits = graph(input_ids, position_ids)`` with ``input_ids`` and ``position_ids`` (B, T): it appends
    the ``T`` tokens to the cache like ``model(input_ids, position_ids=..., past_key_values=cache)`` and returns the
    (B, T, V) logits (a fresh tensor). `cache.crop` between calls works as usual (speculative decoding).
    """

    def __init__(self, model, cache: OasisCache) -> None:
        reason = unsupported(cache)
        if reason is not None:
            raise UnsupportedError(reason)
        self.model = model
        self._cache = weakref.ref(cache)  # the cache owns its runner (`OasisCache.graph_runner`): no cycle
        self._kwarg = compat.cache_kwarg(model)
        # Keyed by (T, whether the forward forks the selection jobs: `OasisConfig.selection_interval` alternates).
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        self._warm: dict[tuple[int, bool], tuple[int, int]] = {}  # -> (the table epoch its eager runs saw, runs)
        self.with_job = False  # this forward forks every layer's selection job (read by the layers)
        self._compiled = None  # the model through torch.compile (OasisConfig.compile_model), built on first use
        self._starts: dict[torch.device, torch.Tensor] = {}  # (2,) long per device: the step's first position, end
        # What the device scalars hold once the queued forwards ran ((first position, end) per device): every forward
        # advances them by its T, so the host fills them only when the next step starts elsewhere (crop, other T).
        self._expected: dict[torch.device, tuple[int, int]] = {}
        self._supported_epoch: int | None = None  # the table epoch `unsupported` last passed at (it is per epoch)
        self._forked: dict[tuple[torch.device, str], torch.cuda.Stream] = {}  # (device, "jobs" | "gather")
        self._pool = None
        self.replays = 0
        self.captures = 0  # graphs captured (a replay of a graph captured before a `OasisCache.reset` adds none)
        self.steps = 0  # forwards run (replays, captures and eager runs)

    @property
    def cache(self) -> OasisCache:
        cache = self._cache()
        if cache is None:
            raise UnsupportedError("this DecodeGraph's OasisCache was garbage-collected: a DecodeGraph holds its cache "
                                   "weakly, so keep a reference to the cache while decoding with it")
        return cache

    def unsupported(self) -> str | None:
        """`unsupported` of this runner's cache, checked once per table epoch (what it reads changes only with the
        epoch: a prefill, a growth of the host store)."""
        cache = self.cache
        if self._supported_epoch == cache.table_epoch:
            return None
        reason = unsupported(cache)
        if reason is None:
            self._supported_epoch = cache.table_epoch
        return reason

    # ------------------------------------------------------------------------------------------ used by layers
    def start(self, device: torch.device) -> torch.Tensor:
        """The step's first position as a 0-d long tensor on `device` (filled before every run or replay)."""
        return self._starts[torch.device(device)][0]

    def end(self, device: torch.device) -> torch.Tensor:
        """The step's first position plus ``T`` (the sequence length after it), a 0-d long tensor on `device`."""
        return self._starts[torch.device(device)][1]

    def fork(self, device: torch.device) -> torch.cuda.Stream | None:
        """The prefetch stream of `device`, ordered after the work issued so far on the current stream (None on the
        CPU); `DecodeGraph` joins it back at the end of the forward."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        stream = self.cache.runtime(device).prefetcher.stream
        stream.wait_stream(torch.cuda.current_stream(device))
        self._forked[device, "jobs"] = stream
        return stream

    def fork_gather(self, device: torch.device) -> torch.cuda.Stream | None:
        """The gather stream of `device`, ordered after the work issued so far on its prefetch stream (a job's
        plan): the transfer runs there while the next layers' jobs score and plan (None on the CPU); joined back at
        the end of the forward like `fork`'s stream."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        prefetcher = self.cache.runtime(device).prefetcher
        prefetcher.gather_stream.wait_stream(prefetcher.stream)
        self._forked[device, "gather"] = prefetcher.gather_stream
        return prefetcher.gather_stream

    # ------------------------------------------------------------------------------------------ the step
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        num_tokens = input_ids.shape[1]
        if input_ids.shape != position_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} differ")
        start = cache.get_seq_length()
        if start == 0:
            raise UnsupportedError("DecodeGraph decodes after a prefill: run the prompt through model(...) first")
        reason = self.unsupported()
        if reason is not None:
            raise UnsupportedError(reason)
        layers = cache.oasis_layers
        device = input_ids.device
        cache.wait()  # jobs of earlier eager steps: finished and ordered before this step
        cache.reserve(start + num_tokens)  # may grow the store: a new table epoch, captured graphs are stale
        current = None
        for layer in layers:
            if layer.writeback_event is not None:  # rows an eager step wrote back: landed before this step reads
                if current is None:
                    current = torch.cuda.current_stream(device)
                current.wait_event(layer.writeback_event)
                layer.writeback_event = None
        scalars = self._starts.get(device)
        if scalars is None:
            scalars = self._starts[device] = torch.zeros(2, dtype=torch.long, device=device)
        if self._expected.pop(device, None) != (start, start + num_tokens):  # unknown until this forward succeeds
            scalars[0].fill_(start)  # fill kernels with the values as arguments: no host buffer to race with
            scalars[1].fill_(start + num_tokens)
        epoch = cache.table_epoch
        self.with_job = layers[0].job_due()  # every layer has run as many decode forwards
        key = (num_tokens, self.with_job)
        entry = self._graphs.get(key)
        graphs = device.type == "cuda" and cache.config.cuda_graphs
        warm_epoch, warm_runs = self._warm.get(key, (None, 0))
        if graphs and entry is not None and entry.epoch == epoch:
            logits = self._replay(entry, input_ids, position_ids)
        elif graphs and warm_epoch == epoch and warm_runs >= self._warmups:
            entry = self._graphs[key] = self._capture(input_ids, position_ids, epoch)
            logits = self._replay(entry, input_ids, position_ids)
        else:
            current = torch.cuda.current_stream(device) if device.type == "cuda" else None
            compiled_before = _compilations()
            logits = self._eager(input_ids, position_ids, current)
            runs = warm_runs + 1 if warm_epoch == epoch else 1
            if runs < self._warmups and self._shape(input_ids) in _SETTLED.get(self.model, ()) \
                    and _compilations() == compiled_before:
                runs = self._warmups  # torch.compile has nothing left to settle for this shape: capture next
            self._warm[key] = (epoch, runs)
        self._expected[device] = (start + num_tokens, start + 2 * num_tokens)  # what the forward left there
        for layer in layers:
            layer.length = start + num_tokens
            layer.decode_forwards += 1
        self.steps += 1
        stats = cache.stats
        stats.decode_layer_steps += len(layers)
        if self.with_job:
            stats.prefetch_jobs += len(layers)
        return logits

    @property
    def _warmups(self) -> int:
        """Eager calls of a ``T`` before its capture (see the module docstring)."""
        return 2 if self.cache.config.compile_model else 1

    def _shape(self, input_ids: torch.Tensor) -> tuple[int, int, int]:
        """What the compiled forward specialises on besides the model: (B, T, host capacity in blocks)."""
        return (*input_ids.shape, self.cache.host_capacity_blocks)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, capture: bool = False) -> torch.Tensor:
        """The model's forward with every OasisLayer on its whole-step path; forked streams joined at the end. With
        `capture`, a compiled model must not compile (that would run its autotuning inside the capture)."""
        model, scope, extra = self.model, contextlib.ExitStack(), {}
        if self.cache.config.compile_model:
            model = self._compiled_model()
            # The capture's static inputs are contiguous: eager calls must show torch.compile the same strides (a
            # position slice of a longer mask has others), or the capture would recompile.
            input_ids, position_ids = input_ids.contiguous(), position_ids.contiguous()
            # Room for a model that breaks its graph elsewhere: a frame per layer and break (a layer's index is a
            # constant), each compiled, then recompiled with the step's position dynamic.
            limit = max(8, 4 * len(self.cache.layers) + 8)
            scope.enter_context(torch._dynamo.config.patch(
                recompile_limit=limit, accumulated_recompile_limit=max(256, 4 * limit), error_on_recompile=capture))
            # The forward traces as one graph: each layer's update and attention are one opaque operator.
            scope.enter_context(step_op.running(self.cache))
            scope.enter_context(torch.no_grad())  # the operator has no backward: a decode step needs none
            extra[step_op.STEP_KWARG] = True
        self.cache.step_runner = self
        try:
            with scope:
                out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                            **{self._kwarg: self.cache}, **extra).logits
        finally:
            self.cache.step_runner = None
        for (device, _), stream in self._forked.items():
            torch.cuda.current_stream(device).wait_stream(stream)
        self._forked.clear()
        for scalars in self._starts.values():  # after the joins: every reader of the step's positions is done
            scalars.add_(input_ids.shape[1])
        return out

    def _compiled_model(self):
        if self._compiled is None:
            mode = self.cache.config.compile_mode
            logger.info("DecodeGraph: compiling %s with torch.compile (OasisConfig.compile_model, mode %s)",
                        type(self.model).__name__, mode or "default")
            self._compiled = torch.compile(self.model, dynamic=None, mode=mode)
        return self._compiled

    def _eager(self, input_ids, position_ids, current) -> torch.Tensor:
        if current is None:
            return self._forward(input_ids, position_ids)
        # On the capture stream, as the capture will run: it creates the library handles and workspaces that stream
        # needs and compiles every Triton variant, so nothing of the kind happens during the capture.
        stream = self.cache.runtime(input_ids.device).capture_stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            logits = self._forward(input_ids, position_ids)
        current.wait_stream(stream)
        logits.record_stream(current)
        return logits

    def _capture(self, input_ids, position_ids, epoch: int) -> _Captured:
        device = input_ids.device
        static_ids, static_pos = input_ids.clone(), position_ids.clone()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

        def forward():
            try:
                return self._forward(static_ids, static_pos, capture=True)
            except BaseException:
                self._forked.clear()
                raise

        try:
            graph, logits = capture_graph(self.cache.runtime(device).capture_stream(), forward, pool=self._pool,
                                          what="whole-step")
        except torch._dynamo.exc.RecompileError as exc:
            raise UnsupportedError(
                f"OasisConfig.compile_model: torch.compile wanted to recompile {type(self.model).__name__} while the "
                f"whole-step graph was being captured (T={input_ids.shape[1]}), which would run its autotuning "
                f"inside the capture ({exc}). This cache is left mid-forward: close it, and decode with "
                "compile_model=False (the same graph without Inductor's fusion)") from exc
        self.captures += 1
        if self.cache.config.compile_model:
            _SETTLED.setdefault(self.model, set()).add(self._shape(input_ids))
        logger.info("DecodeGraph: captured T=%d (%d layers)", input_ids.shape[1], len(self.cache.oasis_layers))
        return _Captured(graph, static_ids, static_pos, logits, epoch)

    def _replay(self, entry: _Captured, input_ids, position_ids) -> torch.Tensor:
        torch._foreach_copy_([entry.input_ids, entry.position_ids], [input_ids, position_ids])  # one launch
        entry.graph.replay()
        self.replays += 1
        self.cache.stats.graph_replays += len(self.cache.oasis_layers)
        return entry.logits.clone()


def graph_runner(model, cache: OasisCache) -> DecodeGraph:
    """`cache`'s `DecodeGraph` for `model`, made on first use and kept on the cache (`OasisCache.graph_runner`):
    after ``cache.reset()`` the next batch of the same shape replays the graphs it captured."""
    runner = cache.graph_runner
    if runner is None or runner.model is not model:
        runner = cache.graph_runner = DecodeGraph(model, cache)
    return runner


@torch.inference_mode()
def decode_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    cache: OasisCache,
    max_new_tokens: int = 128,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Plain decoding (no drafts) of a left-padded batch whose every step is one `DecodeGraph` replay.

    The greedy tokens are those of ``model.generate(input_ids, attention_mask=..., past_key_values=<an OasisCache of
    the same config>, do_sample=False)``; what changes is the host work per step (one launch instead of the model's
    eager modules), which at batch 8 is most of an OasisKV step, and each step is queued before the previous one's
    EOS check reads the device (without EOS ids nothing is read back until the end), so the host's work hides
    behind the GPU's. Greedy or sampling at `temperature`; no stop strings (callers that need them cut the text
    afterwards, as lm-eval does).

    Parameters
    ----------
    model : a causal LM switched to the ``oasis`` attention (`oasis_hf.enable`), all full-attention layers.
    input_ids : (B, P) left-padded prompt ids. attention_mask : (B, P), 1 for real tokens (None: all real).
    cache : an empty `OasisCache` (`DecodeGraph` says which configurations it refuses): a new one, or one reset
        after an earlier call, which replays the graphs that call captured when the batch has the same shape.
    max_new_tokens : tokens to add per sequence. eos_token_id, pad_token_id : a sequence stops at its first EOS;
        later positions hold `pad_token_id` (default: the first EOS id, else 0).

    Returns
    -------
    (B, P + N) ids, N <= `max_new_tokens` (fewer when every sequence ended early).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 with do_sample=True (use do_sample=False for greedy)")
    if not isinstance(cache, OasisCache) or cache.get_seq_length() != 0:
        raise UnsupportedError("decode_generate needs an empty OasisCache; pass a fresh one, or call reset() on it")
    device = input_ids.device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=device).long().flatten()
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    runner = graph_runner(model, cache)
    logits = forward_logits(model, input_ids, mask, cache, last_only=True)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    new = []
    for step in range(max_new_tokens):
        last = logits[:, -1]
        if do_sample:
            token = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=generator).squeeze(-1)
        else:
            token = last.argmax(-1)
        token = torch.where(finished, pad, token)
        new.append(token)
        finished = finished | torch.isin(token, eos)
        if step + 1 == max_new_tokens:
            break
        # The next step is queued before this one's EOS check reads the device, so the host's work for a step (its
        # launches, the check) overlaps the GPU's previous step instead of idling it. A step run after every
        # sequence ended is dropped from the cache again.
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = runner(token[:, None], positions(mask, 1))
        if len(eos) and bool(finished.all()):
            cache.crop(-1)
            break
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)
