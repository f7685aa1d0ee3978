"""A layer's decode step captured as one CUDA graph per query length ``T`` (the per-layer path: ``model(...)`` with
the model's eager modules around it; the whole-step graph, `oasis_hf.DecodeGraph`, captures the whole forward).

Lifecycle per ``T``: the first step runs eagerly on the capture stream (compiling every Triton variant and creating
the library handles that stream needs), the second captures, later ones replay. Everything a step reads or writes
in place (pool, table, summaries, host store, counters) is a persistent tensor of the layer; the graphs are dropped
whenever one of them is reallocated (`StepGraphs.clear`, from the layer's ``grow`` and ``reset``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasis_hf.cache.capture import capture_graph

if TYPE_CHECKING:
    from oasis_hf.cache.layer import OasisLayer

#: Decode / verification forwards of at most this many tokens are captured in CUDA graphs (one graph per ``T``).
GRAPH_MAX_TOKENS = 16


def graphable(layer: OasisLayer, states: torch.Tensor) -> bool:
    """Whether a forward of `states` (B, H, T, D) on `layer` runs as a captured CUDA graph."""
    cache = layer.cache
    return (
        states.is_cuda
        and layer.config.cuda_graphs
        and cache.selector.capturable
        and cache.host.pin
        and states.shape[2] <= GRAPH_MAX_TOKENS
        and not torch.cuda.is_current_stream_capturing()
    )


class StepGraph:
    """`OasisLayer.decode_step` for one ``T``, captured with static inputs.

    Replaying costs a handful of launches (input copies, the start position, the replay, the output copy) instead of
    the step's own launches and Python.
    """

    def __init__(self, layer: OasisLayer, query, key, value, scale: float, stream: torch.cuda.Stream) -> None:
        self.device = layer.device
        self.scale = scale
        self.query = torch.empty_like(query, memory_format=torch.contiguous_format)
        self.key = torch.empty_like(key, memory_format=torch.contiguous_format)
        self.value = torch.empty_like(value, memory_format=torch.contiguous_format)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)
        self.graph, self.out = capture_graph(
            stream,
            lambda: layer.decode_step(self.query, self.key, self.value, self.start, scale, write_back=True),
            pool=layer.cache.graph_pool(self.device, "step"), what="decode step",
        )  # fmt: skip

    def run(self, query, key, value, start: int) -> torch.Tensor:
        """Replay on the current stream: (B, H_q, T, D) query -> (B, T, H_q, D), a fresh tensor."""
        self.query.copy_(query)
        self.key.copy_(key)
        self.value.copy_(value)
        self.start.fill_(start)  # a fill kernel with the value as argument: no host buffer to race with
        self.graph.replay()
        return self.out.clone()


class StepGraphs:
    """The captured decode steps of one layer, by ``T``, and which ``T`` already ran their eager warm-up."""

    def __init__(self) -> None:
        self.graphs: dict[int, StepGraph] = {}
        self.warm: set[int] = set()

    def clear(self) -> None:
        """Drop every graph; each ``T`` warms up eagerly again before its next capture (a compilation inside a
        capture invalidates it, and a reallocated table needs new kernel variants)."""
        self.graphs.clear()
        self.warm.clear()

    def pool(self, device: torch.device):
        """The memory pool of a live graph on `device`, or None."""
        return next((g.graph.pool() for g in self.graphs.values() if g.device == device), None)

    def run(self, layer: OasisLayer, query, key, value, scale: float, start: int):
        """This ``T``'s step: eager warm-up, capture, or replay. Returns ``(out, query, start, graphed)``: the output
        and the query and start tensors the step read (the selection job reads them too), and whether it replayed."""
        num_tokens = query.shape[2]
        graph = self.graphs.get(num_tokens)
        if graph is None or graph.scale != scale:
            cache = layer.cache
            stream = cache.runtime(layer.device).capture_stream()
            if num_tokens not in self.warm:
                self.warm.add(num_tokens)
                stream.wait_stream(torch.cuda.current_stream(layer.device))
                with torch.cuda.stream(stream):
                    start_t = torch.full((), start, dtype=torch.long, device=layer.device)
                    out = layer.decode_step(query, key, value, start_t, scale, write_back=True)
                compute = torch.cuda.current_stream(layer.device)
                compute.wait_stream(stream)
                for tensor in (out, query, start_t):
                    tensor.record_stream(compute)
                return out, query, start_t, False
            cache.wait()  # no selection job in flight while capturing (its stream must not touch our state)
            graph = self.graphs[num_tokens] = StepGraph(layer, query, key, value, scale, stream)
            layer.jobs.forget_graph(num_tokens)  # a job graph reads the old step graph's buffers
        layer.cache.stats.graph_replays += 1
        return graph.run(query, key, value, start), graph.query, graph.start, True
