"""Per-layer CUDA graphs for a model split over several GPUs: each decoder layer's forward captured on its own device.

PyTorch cannot capture one CUDA graph across GPUs, so a model whose layers accelerate's ``device_map`` spread over
several devices cannot run its decode step as one replay. `LayerGraphs` wraps each decoder layer module instead (as
``torch.cuda.make_graphed_callables`` does for training, here for inference): the first call of an input signature
runs as it is; the second copies its inputs into static buffers on the layer's device, runs the forward on them once
on a side stream of that device (compiling, allocating workspaces), captures it and replays; later calls copy their
inputs into those buffers and replay. The glue between the layers (embeddings, rotary tables, the final norm, the LM
head, accelerate's moves between devices) stays eager: a few launches per step against a layer's dozens.

The layers' own forwards run unchanged, so any decoder layer works whose forward has fixed shapes for fixed input
shapes, reads everything else from device memory and can run twice on the same inputs with the same result (the
dense-graphed attention of `eval.dense_baselines` writes its K/V at a position held in a device tensor): the call
that captures runs the forward once more as a warm-up before its replay. A cache that appends on every forward (a
`DynamicCache`, an `OasisCache`) would append twice there, so those stay on their own paths. On the CPU nothing is
captured: a call copies its inputs into the static buffers and runs the layer on them, the same data path without
the graph.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)


class _Captured:
    """One input signature of one layer: its static inputs, the graph (None on the CPU) and its static output."""

    def __init__(self, forward, args, kwargs, device: torch.device, pool) -> None:
        leaves, self.spec = tree_flatten((args, kwargs))
        self.static = [leaf.to(device, copy=True) if torch.is_tensor(leaf) else leaf for leaf in leaves]
        self.forward = forward
        self.graph = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.device(device), torch.cuda.stream(stream):
                self._run()  # warm-up: Triton compilation, library workspaces, allocator growth
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.graph(self.graph, pool=pool, stream=stream):
                self.output = self._run()
        else:
            self.output = None

    def _run(self):
        args, kwargs = tree_unflatten(self.static, self.spec)
        return self.forward(*args, **kwargs)

    def __call__(self, leaves: list):
        for static, leaf in zip(self.static, leaves, strict=True):
            if torch.is_tensor(leaf):
                static.copy_(leaf, non_blocking=True)
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.output


def _signature(leaves: list) -> tuple:
    """What a capture depends on: the tensors' shapes and dtypes, and every other argument's value."""
    return tuple((tuple(leaf.shape), leaf.dtype) if torch.is_tensor(leaf) else ("value", repr(leaf))
                 for leaf in leaves)


class LayerGraphs(contextlib.AbstractContextManager):
    """Capture and replay each of `layers`' forwards on its own device while the context is open.

    Parameters
    ----------
    layers : the decoder layer modules (e.g. ``model.model.layers``), each on one device (its parameters').

    Entering wraps every layer's ``forward`` (after accelerate's device hooks, which then see inputs already on the
    layer's device); leaving puts the original ``forward`` back and drops the graphs. A layer's graph is captured on
    its second call of an input signature (the first warms up); `captures` counts the captures made.
    """

    def __init__(self, layers) -> None:
        self.layers = list(layers)
        self.captures = 0
        self._saved: list = []
        self._pools: dict[torch.device, object] = {}

    def __enter__(self) -> LayerGraphs:
        for layer in self.layers:
            device = next(layer.parameters()).device
            # An instance attribute (accelerate's hooked forward) is put back as it was; the class's is un-shadowed.
            self._saved.append((layer, vars(layer).get("forward")))
            layer.forward = self._wrap(layer.forward, device)
        return self

    def __exit__(self, *exc) -> None:
        for layer, own in self._saved:
            if own is None:
                del layer.forward
            else:
                layer.forward = own
        self._saved.clear()
        self._pools.clear()

    def _wrap(self, original, device: torch.device):
        graphs: dict[tuple, _Captured] = {}
        seen: set[tuple] = set()

        def forward(*args, **kwargs):
            leaves, _ = tree_flatten((args, kwargs))
            key = _signature(leaves)
            captured = graphs.get(key)
            if captured is None:
                if key not in seen:  # the first call of a signature runs as it is (the model's own first step)
                    seen.add(key)
                    return original(*args, **kwargs)
                pool = self._pools.get(device)
                if pool is None and device.type == "cuda":
                    pool = self._pools[device] = torch.cuda.graph_pool_handle()
                captured = graphs[key] = _Captured(original, args, kwargs, device, pool)
                self.captures += 1
            return captured(leaves)

        return forward
