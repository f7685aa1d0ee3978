"""``oasis::whole_step_attention``: a layer's cache update and attention as one operator, for compiled models.

With `OasisConfig.compile_model` a `oasis_hf.DecodeGraph` runs the model through ``torch.compile``. Called as they
are everywhere else, `OasisCache.update` and the ``oasis`` attention function are graph breaks (they run host code
and our kernels), so Inductor compiles each layer in pieces and fuses nothing across them: a layer's closing
residual add, for one, stays a kernel of its own instead of joining the next layer's norm. Inside a compiled
whole-step forward (`running`) instead:

- `OasisCache.update`, while traced, returns the step's K/V as they are;
- the ``oasis`` attention, given the `STEP_KWARG` keyword the runner adds to the model's call (transformers hands a
  forward's extra keywords down to the attention function), calls this operator, which the compiler keeps opaque
  (its fake only gives the output's shape). Run, it does what the two calls did: the cache update, then the layer's
  whole-step attention (`OasisLayer.attend`).

The decode forward then traces as one graph. The operator reads the step's query after it returns (the selection
job scores with it on the prefetch stream), so the compiled forward must not hand that memory to a later kernel
before the job is done: `running` compiles with Inductor's buffer reuse off, which leaves every buffer's lifetime to
the caching allocator, where ``record_stream`` holds it. A model whose forward drops the keyword would attend over
the step's new tokens alone; the attention refuses that with a clear error (`check_not_running`).

The operator is registered with ``torch.library`` on first use (`running`), not at import.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from oasis_hf.cache.layer import layer_of
from oasis_hf.errors import UnsupportedError

#: The keyword `oasis_hf.DecodeGraph` adds to a compiled model's forward; the attention function receives it.
STEP_KWARG = "oasis_whole_step"
_NAME = "oasis::whole_step_attention"
_local = threading.local()  # .cache: the OasisCache whose compiled whole-step forward this thread runs
_registered = False


def _whole_step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                          scale: float) -> torch.Tensor:
    """The cache update of layer `layer_idx` with `key` / `value` (B, H_kv, T, D), then its whole-step attention of
    `query` (B, H_q, T, D): the (B, T, H_q, D) output."""
    cache = getattr(_local, "cache", None)
    if cache is None:
        raise UnsupportedError(f"{_NAME} runs inside a compiled DecodeGraph forward only (OasisConfig.compile_model)")
    layer = layer_of(key)
    if layer is None:  # traced: the update returned the K/V as they were (not compiled: it ran, and marked them)
        key, value = cache.update(key, value, layer_idx)
        layer = layer_of(key)
    return layer.attend(query, key, value, None, scale)


def _fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    batch, heads, tokens, dim = query.shape
    return query.new_empty((batch, tokens, heads, dim))


def _register() -> None:
    global _registered
    if not _registered:
        op = torch.library.custom_op(_NAME, mutates_args=())(_whole_step_attention)
        op.register_fake(_fake)
        _registered = True


@contextlib.contextmanager
def running(cache) -> Iterator[None]:
    """The scope of one compiled whole-step forward over `cache` in this thread: the operator registered, `cache`'s
    traced updates deferred to it, and Inductor compiling without buffer reuse (see the module docstring)."""
    import torch._inductor.config  # noqa: PLC0415 (Inductor's config, loaded only where a model compiles)

    _register()
    if getattr(_local, "cache", None) is not None:
        raise UnsupportedError("a compiled whole-step forward is already running in this thread")
    _local.cache = cache
    cache.compiled_step = True
    try:
        with torch._inductor.config.patch(allow_buffer_reuse=False):
            yield
    finally:
        cache.compiled_step = False
        _local.cache = None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
              scale: float) -> torch.Tensor:
    """The operator's call, as the ``oasis`` attention makes it inside a compiled whole-step forward."""
    return torch.ops.oasis.whole_step_attention(query, key, value, layer_idx, scale)


def check_not_running(layer_idx) -> None:
    """Refuse attention over unmarked K/V while a compiled whole-step forward runs in this thread: the model's
    forward did not pass `STEP_KWARG` down to its attention, whose cache update was deferred."""
    if getattr(_local, "cache", None) is not None:
        raise UnsupportedError(
            f"model layer {layer_idx}: its attention did not receive the {STEP_KWARG!r} keyword of a compiled "
            "whole-step forward (the model's forward does not pass its keywords down to the attention function), "
            "so its cache update did not run. Close this cache (it is left mid-forward) and decode this model with "
            "OasisConfig(compile_model=False)"
        )
