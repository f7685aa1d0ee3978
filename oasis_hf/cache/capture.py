"""CUDA graph capture: the one helper behind every graph the library records (a layer's decode step and selection
job, the whole-step graph `oasis_hf.DecodeGraph`, the draft's step `oasis_hf.draft.GraphedDraft`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from oasis_hf.cache.pinned import capturing

logger = logging.getLogger(__name__)

T = TypeVar("T")


def capture_graph(stream: torch.cuda.Stream, fn: Callable[[], T], pool=None,
                  what: str = "graph") -> tuple[torch.cuda.CUDAGraph, T]:
    """Capture ``fn()`` on `stream` into a new CUDA graph; returns ``(graph, fn's result)``.

    The graph allocates from `pool` (a ``graph_pool_handle`` or another graph's ``pool()``; None: a private one).
    The current stream's work so far is ordered before the capture, and the current stream waits for `stream` after
    it. The capture is ``thread_local``: another thread (the prefetch worker) may call the CUDA API on its own stream
    meanwhile. `capturing` is entered before ``capture_begin``: a collected cache's host buffers are unregistered,
    and its graphs destroyed, after the capture, not inside it. When `fn` raises, the invalid capture is ended
    quietly and `fn`'s error propagates (``capture_end`` would raise "operation failed due to a previous error during
    capture" and hide it); `what` names the graph in the debug log of that.
    """
    current = torch.cuda.current_stream(stream.device)
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(current)
    with torch.cuda.stream(stream), capturing():
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            result = fn()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:  # noqa: BLE001 - the capture is invalid either way
                logger.debug("capture_end after a failed %s capture", what, exc_info=True)
            raise
        graph.capture_end()
    current.wait_stream(stream)
    return graph, result
