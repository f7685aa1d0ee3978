"""The dense decodes every OasisKV speed figure is compared with, and the byte floor of a decode step.

- ``dense-graphed``: the fastest dense decode we can build inside transformers. Preallocated K/V buffers per layer,
  an attention function (registered with `AttentionInterface`, the model runs with ``use_cache=False``) that writes
  the step's K/V at its position and attends over the valid prefix, and the whole forward captured once in a
  `torch.cuda.CUDAGraph` and replayed. Two attention kernels: SDPA with ``enable_gqa=True`` over
  ``k[:, :, :n]`` (no mask, no ``repeat_kv``), and our Triton split-K kernel over every block of the buffer (a paged
  decode kernel reading the length from device memory). A replay decodes one token at the captured position (the
  step's cost at that context; the benchmark replays it, writing the same position). Its logits are checked against
  eager dense attention over the same K/V (`check_dense_graphed`). Optionally the forward it captures is the model
  through ``torch.compile`` (Inductor: norms, RoPE and activations fused; no graph break, the attention function is
  traced too), the same treatment as OasisKV's `OasisConfig.compile_model`.
- ``dense-eager``: transformers' `DynamicCache` with SDPA, one eager forward per step (``torch.cat`` every step).
- ``dense-compile``: transformers' recipe, a `StaticCache` and ``torch.compile(model.forward,
  mode="reduce-overhead")`` (SDPA over the whole static buffer with a mask).
- ``floor``: (the bytes a step must read) / (the device-to-device copy bandwidth measured in the same process):
  every weight except the input embedding table (B rows of it), plus the K/V the step attends over; for OasisKV the
  resident budget and, for the selectors that score, one read of the block summaries.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.masking_utils import AttentionMaskInterface

from eval._common import median, percentile, pipelined_ms, time_steps
from eval.layer_graphs import LayerGraphs
from oasis_hf import compat
from oasis_hf.config import blocks_for
from oasis_hf.kernels import sparse_attention, sparse_attention_ref, use_triton

logger = logging.getLogger("eval.dense_baselines")

GIB = 2**30
PREFIX_ATTENTION = "bench_dense_prefix"
#: Dense-graphed attention kernels: SDPA over the valid prefix, or our Triton split-K kernel over all blocks.
KERNELS = ("sdpa", "triton")


def _copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Median seconds of ``dst.copy_(src)`` over `repeats` copies after two (CUDA events when `dst` is on a GPU, the
    copy enqueued without a host wait; a host clock otherwise)."""
    cuda = dst.is_cuda
    times = []
    for _ in range(repeats + 2):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return median(times[2:])


def hbm_bandwidth(device, nbytes: int = 4 * GIB, repeats: int = 10) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted), median of `repeats` (CUDA events;
    on the CPU a host clock, for smoke runs)."""
    device = torch.device(device)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()  # `nbytes` bytes
    seconds = _copy_seconds(torch.empty_like(src), src, repeats)
    del src
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def h2d_bandwidth(device, nbytes: int = GIB, repeats: int = 10) -> float:
    """Bytes per second of a large copy from pinned host memory to `device` on a copy engine (the most the host link,
    PCIe on our machines, moves in one direction), median of `repeats` (CUDA events; on the CPU a host clock, for
    smoke runs)."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    seconds = _copy_seconds(torch.empty(nbytes, dtype=torch.uint8, device=device), src, repeats)
    del src
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return nbytes / seconds


def weight_bytes(model, batch: int) -> int:
    """Parameter bytes one decode step reads: all of them, the input embedding table counted for its `batch` rows."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    if tied:  # the LM head reads the whole table anyway
        return total
    return total - embed.numel() * embed.element_size() + batch * embed.shape[1] * embed.element_size()


def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token over all layers."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem


def floor_ms(model, batch: int, kv_tokens: int, bandwidth: float, extra_bytes: int = 0) -> float:
    """Milliseconds to read the weights, `kv_tokens` tokens of K/V per sequence and `extra_bytes` at `bandwidth`."""
    nbytes = weight_bytes(model, batch) + batch * kv_tokens * kv_bytes_per_token(model) + extra_bytes
    return nbytes / bandwidth * 1e3


class PrefixDecode:
    """Preallocated K/V for `batch` x `capacity` tokens per layer and the attention function that uses them.

    The model runs with ``use_cache=False``: its attention modules call `attention` with the step's (B, H, T, D)
    queries and K/V; the function writes the K/V at `position` (a device tensor) and attends over the first
    `valid` positions (a Python int, fixed when the forward is captured).

    Each layer's buffers live on that layer's device (a model split over GPUs by accelerate's ``device_map``), with
    a copy of the step's scalars per device; `position`, `length`, `kv_start` and `slot_block` are the first
    device's, and `set_step` sets them all (the end-to-end loop that advances them itself runs on one device).
    """

    def __init__(self, model, batch: int, capacity: int, kernel: str = "sdpa", block_size: int = 32) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"unknown dense kernel {kernel!r}; choose one of {KERNELS}")
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        devices = [next(layer.parameters()).device for layer in model.model.layers]
        capacity = blocks_for(capacity, block_size) * block_size
        shape = (batch, cfg.num_key_value_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=param.dtype, device=device) for device in devices]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.kernel, self.block_size = kernel, block_size
        self.valid = 0
        blocks = capacity // block_size
        self._scalars = {}  # device -> (position, length, kv_start, slot_block)
        for device in [param.device, *devices]:
            if device not in self._scalars:
                self._scalars[device] = (
                    torch.zeros(1, dtype=torch.long, device=device),
                    torch.zeros((), dtype=torch.long, device=device),  # valid tokens, for the Triton kernel
                    torch.zeros(batch, dtype=torch.long, device=device),
                    torch.arange(blocks, device=device).expand(batch, cfg.num_key_value_heads, -1),
                )
        self.position, self.length, self.kv_start, self.slot_block = self._scalars[param.device]
        self.register()

    def register(self) -> None:
        """Make `attention` the registered ``PREFIX_ATTENTION`` function (the latest `PrefixDecode` made holds it)."""
        AttentionInterface.register(PREFIX_ATTENTION, self.attention)
        AttentionMaskInterface.register(PREFIX_ATTENTION, compat.flash_attention_mask)

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k in self.keys)

    def fill_random(self, tokens: int, seed: int = 0) -> None:
        """Random K/V at positions ``0 .. tokens - 1`` of every layer."""
        gens = {device: torch.Generator(device=device).manual_seed(seed) for device in self._scalars}
        for k, v in zip(self.keys, self.values, strict=True):
            k[:, :, :tokens].normal_(generator=gens[k.device])
            v[:, :, :tokens].normal_(generator=gens[k.device])

    def set_step(self, position: int) -> None:
        """The next forward decodes the token at `position` (attends over ``position + 1`` tokens), on every device."""
        for step_position, length, _, _ in self._scalars.values():
            step_position.fill_(position)
            length.fill_(position + 1)
        self.valid = position + 1

    def attention(self, module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        if query.shape[2] != 1:
            raise ValueError(f"{PREFIX_ATTENTION} decodes one token per forward, got {query.shape[2]}")
        layer = module.layer_idx
        keys, values = self.keys[layer], self.values[layer]
        position, length, kv_start, slot_block = self._scalars[keys.device]
        keys.index_copy_(2, position, key)
        values.index_copy_(2, position, value)
        if self.kernel == "sdpa":
            n = self.valid
            out = F.scaled_dot_product_attention(query, keys[:, :, :n], values[:, :, :n], scale=scaling,
                                                 enable_gqa=True)
            return out.transpose(1, 2), None
        batch, heads, capacity, head_dim = keys.shape
        pool = (batch, heads, capacity // self.block_size, self.block_size, head_dim)
        attend = sparse_attention if use_triton(query, "auto") else sparse_attention_ref  # the twin on the CPU
        out = attend(query, keys.view(pool), values.view(pool), slot_block, length, kv_start,
                     scaling if scaling is not None else head_dim**-0.5)
        return out, None


@torch.inference_mode()
def forward_prefix(model, decode: PrefixDecode, token: torch.Tensor) -> torch.Tensor:
    """One dense decode forward of `token` (B, 1) at `decode`'s position; (B, V) logits."""
    position = torch.full_like(token, decode.valid - 1)
    return model(input_ids=token, position_ids=position, use_cache=False, logits_to_keep=1).logits[:, -1]


class _Eager:
    """A stand-in for a captured graph on the CPU (smoke runs): `replay` runs the function again."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self):
        return self.fn()


def _graph(fn, device: torch.device):
    """Warm `fn` up on a side stream, capture it in a CUDA graph; returns (graph, its output). On the CPU the
    function itself stands in (no capture)."""
    if device.type != "cuda":
        return _Eager(fn), fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class DenseGraphedSession:
    """What `dense_graphed_generate` keeps from one call to the next when handed one, as a server keeps its decode
    buffers and captured graphs (and as `oasis_hf.CacheSlot` keeps an OasisCache's): the preallocated K/V, the
    step's input tensors and its captured graph, for one (batch, capacity, compiled) shape; a call of another shape
    replaces them."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.decode: PrefixDecode | None = None
        self.token: torch.Tensor | None = None  # (B, 1) the step's input token, written by the step itself
        self.positions: torch.Tensor | None = None  # (B, 1) its position
        self.target = None  # the model, or the model through torch.compile
        self.graph = None  # the captured step (None until a call captured it, or without graphs)
        self.captures = 0


@torch.inference_mode()
def dense_graphed_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                           graphs: bool = True, compiled: bool = False, capacity: int | None = None,
                           session: DenseGraphedSession | None = None) -> tuple[torch.Tensor, float]:
    """Greedy generation the dense-graphed way, end to end: a prefill over a `DynamicCache`, its K/V copied into
    preallocated buffers, then every decode step one replay of a captured forward whose attention (our Triton
    split-K kernel, the PyTorch twin on the CPU) reads the length from device memory, so one graph serves every
    step. Left padding is honoured (positions from the mask, padded keys masked). No EOS stop: `max_new_tokens`
    tokens per sequence, like ``min_new_tokens=max_new_tokens`` in ``generate``.

    `compiled`: every decode step runs the model through ``torch.compile`` (compiled in the first step, which runs
    eagerly before the capture). `capacity`: K/V slots per sequence (default: the prompt plus `max_new_tokens`).
    ``torch.compile`` specialises on the buffers' shape, so calls that should share one compilation (a warm-up
    and the timed call after it) pass the same `capacity`; a new one recompiles, tens of seconds on a GPU.
    `session`: buffers and graph kept across calls (`DenseGraphedSession`); a call of the shape of the previous one
    replays the graph that call captured, with no eager step and no capture of its own.

    Returns ``(sequences (B, L + max_new_tokens), seconds to the first token)``.
    """
    device = input_ids.device
    batch, length = input_ids.shape
    needed = length + max_new_tokens
    if capacity is not None and capacity < needed:
        raise ValueError(f"capacity={capacity} is below the prompt ({length}) plus max_new_tokens ({max_new_tokens})")
    capacity = capacity or needed
    session = session if session is not None else DenseGraphedSession()
    key = (batch, capacity, compiled, graphs, device)
    if session.key != key:
        session.key, session.graph = None, None  # the old buffers go before the new ones are made
        session.decode = PrefixDecode(model, batch, capacity, kernel="triton")
        session.token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        session.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        session.target = _target(model, compiled)
        session.key = key
    else:
        session.decode.register()
    decode, token, positions = session.decode, session.token, session.positions
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    prompt_positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # as generate
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=prompt_positions, use_cache=True,
                logits_to_keep=1, **{compat.cache_kwarg(model): cache})
    token.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ttft = time.perf_counter() - t0
    for layer, k, v in zip(cache.layers, decode.keys, decode.values, strict=True):
        k[:, :, :length].copy_(layer.keys)
        v[:, :, :length].copy_(layer.values)
    del cache, out
    decode.kv_start.copy_(attention_mask.to(torch.bool).int().argmax(-1))
    decode.set_step(length)
    positions.copy_(attention_mask.long().sum(-1, keepdim=True))  # the first new token's position per sequence
    tokens = [token.clone()]
    previous = model.config._attn_implementation
    model.set_attn_implementation(PREFIX_ATTENTION)
    target = session.target

    def step():
        logits = target(input_ids=token, position_ids=positions, use_cache=False, logits_to_keep=1).logits[:, -1]
        token.copy_(logits.argmax(-1, keepdim=True))
        positions.add_(1)
        decode.position.add_(1)
        decode.length.add_(1)

    try:
        steps = max_new_tokens - 1
        if steps and graphs and device.type == "cuda":
            if session.graph is None:  # the first step eagerly on a side stream (warm-up), then capture
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    step()
                torch.cuda.current_stream(device).wait_stream(stream)
                tokens.append(token.clone())
                steps -= 1
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()  # captured, not run: the replays below run it
                session.graph = graph
                session.captures += 1
            for _ in range(steps):
                session.graph.replay()
                tokens.append(token.clone())
        else:
            for _ in range(steps):
                step()
                tokens.append(token.clone())
    finally:
        model.set_attn_implementation(previous)
    return torch.cat([input_ids, *tokens], dim=1), ttft


def graphed_label(kernel: str, compiled: bool, mode: str | None = None) -> str:
    return f"dense graphed ({kernel}{compile_label(compiled, mode)})"


def compile_label(compiled: bool, mode: str | None) -> str:
    """The suffix naming how a row's model ran: nothing, ``, torch.compile`` or ``, torch.compile <mode>``."""
    return f", torch.compile{f' {mode}' if mode else ''}" if compiled else ""


def _target(model, compiled: bool, mode: str | None = None):
    """`model`, or `model` through ``torch.compile`` in `mode` (static shapes: one decode shape per capture)."""
    return torch.compile(model, dynamic=False, mode=mode) if compiled else model


@contextlib.contextmanager
def prefix_step(model, batch: int, context: int, kernel: str = "sdpa", seed: int = 0):
    """`PrefixDecode` buffers of `batch` sequences filled with `context` random tokens, set to decode the next one,
    with `model` on their attention while the block runs: yields ``(decode, token)``, `token` (B, 1) random ids on
    the first layer's device; afterwards the previous attention is back and the buffers are freed."""
    previous = model.config._attn_implementation
    decode = PrefixDecode(model, batch, context + 1, kernel)  # registers its attention function
    model.set_attn_implementation(PREFIX_ATTENTION)
    try:
        decode.fill_random(context, seed=seed)
        decode.set_step(context)
        yield decode, torch.randint(0, model.config.vocab_size, (batch, 1), device=decode.position.device)
    finally:
        model.set_attn_implementation(previous)
        del decode
        _empty_cache()


def dense_graphed_row(model, batch: int, context: int, warmup: int, repeats: int, kernel: str = "sdpa",
                      profile=None, compiled: bool = False, mode: str | None = None) -> dict:
    """Time the dense-graphed decode step at `context` tokens (random K/V); ``profile(step)``, when given, returns
    what the row records under ``"profile"`` (e.g. a kernel-family table of a few replays). `compiled`: capture the
    model through ``torch.compile`` in `mode` (compiled in the warm-up before the capture)."""
    try:
        with prefix_step(model, batch, context, kernel) as (decode, token):
            target = _target(model, compiled, mode)
            t0 = time.perf_counter()
            graph, _ = _graph(lambda: forward_prefix(target, decode, token), token.device)
            capture_s = time.perf_counter() - t0
            enqueue: list[float] = []
            times = time_steps(graph.replay, warmup, repeats, enqueue)
            row = {"method": graphed_label(kernel, compiled, mode), "kind": "dense-graphed", "compiled": compiled,
                   "compile mode": mode if compiled else None,
                   "compile + capture s": capture_s, "context": context, "batch": batch,
                   "ms/step (median)": median(times), "ms/step (p90)": percentile(times, 0.9),
                   "tokens/s": batch * 1e3 / median(times), "host enqueue ms/step": median(enqueue),
                   "ms/step (no per-step sync)": pipelined_ms(graph.replay, repeats),
                   "GPU KV MiB/seq": decode.nbytes / batch / 2**20, "host MiB/seq": 0.0, "raw_ms": times}
            if profile is not None:
                row["profile"] = profile(graph.replay)
            return row
    finally:
        if compiled:
            torch.compiler.reset()


@torch.inference_mode()
def dense_layer_graphed_row(model, batch: int, context: int, warmup: int, repeats: int, kernel: str = "sdpa") -> dict:
    """The dense-graphed decode step of a model whose layers are split over several GPUs: the same preallocated K/V
    and attention as `dense_graphed_row`, each layer's buffers on its device, every decoder layer one CUDA graph
    replay on its own device (`eval.layer_graphs.LayerGraphs`; one graph across GPUs cannot be captured), the glue
    between them eager. Its logits are checked against the same step without graphs first."""
    with prefix_step(model, batch, context, kernel) as (decode, token):
        reference = forward_prefix(model, decode, token).float()  # the step repeats: it rewrites the same K/V
        with LayerGraphs(model.model.layers) as graphs:
            t0 = time.perf_counter()
            for _ in range(3):  # eager, capture, replay
                out = forward_prefix(model, decode, token)
            capture_s = time.perf_counter() - t0
            diff = (out.float().to(reference.device) - reference).abs().max().item()

            def step():
                forward_prefix(model, decode, token)

            enqueue: list[float] = []
            times = time_steps(step, warmup, repeats, enqueue)
            queued = pipelined_ms(step, repeats)
        return {"method": f"dense graphed ({kernel}, one CUDA graph per layer on its device)",
                "kind": "dense-graphed", "capture s": capture_s, "context": context, "batch": batch,
                "ms/step (median)": median(times), "ms/step (p90)": percentile(times, 0.9),
                "tokens/s": batch * 1e3 / median(times), "host enqueue ms/step": median(enqueue),
                "ms/step (no per-step sync)": queued, "GPU KV MiB/seq": decode.nbytes / batch / 2**20,
                "host MiB/seq": 0.0, "layer graphs": graphs.captures,
                "devices": sorted({str(k.device) for k in decode.keys}), "max abs logit diff vs eager": diff,
                "raw_ms": times}


@torch.inference_mode()
def check_dense_graphed(model, batch: int, context: int, kernel: str = "sdpa", compiled: bool = False,
                        mode: str | None = None) -> dict:
    """Logits of a graphed dense step against an eager SDPA forward over a `DynamicCache` holding the same K/V."""
    try:
        with prefix_step(model, batch, context, kernel, seed=1) as (decode, token):
            target = _target(model, compiled, mode)
            graph, out = _graph(lambda: forward_prefix(target, decode, token), token.device)
            if token.device.type == "cuda":
                graph.replay()  # the captured output buffer now holds this replay's logits
            else:
                out = graph.replay()
            graphed = out.float().clone()
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            for idx, (k, v) in enumerate(zip(decode.keys, decode.values, strict=True)):
                cache.update(k[:, :, :context].clone(), v[:, :, :context].clone(), idx)
            eager = model(input_ids=token, position_ids=torch.full_like(token, context), use_cache=True,
                          logits_to_keep=1, **{compat.cache_kwarg(model): cache}).logits[:, -1].float()
            diff = (graphed - eager).abs().max().item()
            return {"context": context, "batch": batch, "kernel": kernel, "compiled": compiled,
                    "max abs logit diff": diff, "max abs logit": eager.abs().max().item(),
                    "same argmax": bool((graphed.argmax(-1) == eager.argmax(-1)).all())}
    finally:
        if compiled:
            torch.compiler.reset()


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fill_cache(model, cache, batch: int, context: int, seed: int = 0) -> None:
    """Random K/V for `context` tokens in every layer of a transformers cache (positions passed for 5.17's
    `StaticCache`, which writes at ``cache_kwargs["cache_position"]``)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    param = next(model.parameters())
    gen = torch.Generator(device=param.device).manual_seed(seed)
    positions = torch.arange(context, device=param.device)
    for idx in range(cfg.num_hidden_layers):
        shape = (batch, cfg.num_key_value_heads, context, head_dim)
        k = torch.randn(shape, generator=gen, dtype=param.dtype, device=param.device)
        v = torch.randn(shape, generator=gen, dtype=param.dtype, device=param.device)
        cache.update(k, v, idx, {"cache_position": positions})
        del k, v


@torch.inference_mode()
def dense_eager_row(model, batch: int, context: int, warmup: int, repeats: int) -> dict:
    """transformers' eager decode: `DynamicCache`, SDPA, one forward per step."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    fill_cache(model, cache, batch, context)
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=next(model.parameters()).device)
    kwarg = compat.cache_kwarg(model)

    def step():
        nonlocal token
        pos = torch.full_like(token, cache.get_seq_length())
        logits = model(input_ids=token, position_ids=pos, use_cache=True, logits_to_keep=1, **{kwarg: cache}).logits
        token = logits[:, -1:].argmax(-1)

    enqueue: list[float] = []
    times = time_steps(step, warmup, repeats, enqueue)
    kv = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
    return {"method": "dense eager (DynamicCache, sdpa)", "kind": "dense-eager", "context": context, "batch": batch,
            "ms/step (median)": median(times), "ms/step (p90)": percentile(times, 0.9),
            "tokens/s": batch * 1e3 / median(times), "host enqueue ms/step": median(enqueue),
            "GPU KV MiB/seq": kv / batch / 2**20, "host MiB/seq": 0.0, "raw_ms": times}


@torch.inference_mode()
def dense_compile_row(model, batch: int, context: int, warmup: int, repeats: int) -> dict:
    """transformers' compile recipe: `StaticCache` + ``torch.compile(model.forward, mode="reduce-overhead")``."""
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=context + warmup + repeats + 8)
    fill_cache(model, cache, batch, context)
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    kwarg = compat.cache_kwarg(model)
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    position = [context]

    def step():
        nonlocal token
        pos = torch.full_like(token, position[0])
        logits = compiled(input_ids=token, position_ids=pos, cache_position=pos[0], use_cache=True,
                          logits_to_keep=1, **{kwarg: cache}).logits
        token = logits[:, -1:].argmax(-1).clone()
        position[0] += 1

    t0 = time.perf_counter()
    step()  # compiles
    compile_s = time.perf_counter() - t0
    enqueue: list[float] = []
    times = time_steps(step, warmup, repeats, enqueue)
    kv = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
    torch.compiler.reset()
    return {"method": "dense compile (StaticCache + torch.compile reduce-overhead)", "kind": "dense-compile",
            "context": context, "batch": batch, "ms/step (median)": median(times),
            "ms/step (p90)": percentile(times, 0.9), "tokens/s": batch * 1e3 / median(times),
            "host enqueue ms/step": median(enqueue), "GPU KV MiB/seq": kv / batch / 2**20, "host MiB/seq": 0.0,
            "compile s": compile_s, "raw_ms": times}
