"""What launching a CUDA graph costs the host, by the graph's shape: one stream, or layers forking branches onto side
streams (at default or highest priority, joined after each layer or once at the end), as `oasis_hf.DecodeGraph`'s
whole-step graph does.

    python -m eval.bench_graph_launch --layers 32 --kernels 16 --out eval/results/graph_launch_h200

Why: a synchronised OasisKV step (speculative decoding's rounds wait for every step) pays the host time of its
replay on top of the GPU's, and in the floor runs that was 0.065-0.32 ms against 0.007-0.09 ms for dense graphed,
whose graph is one stream. `DecodeGraph`'s own bookkeeping around the forward takes about 10 us on the CPU, and
joining the write-back branch once per step instead of after every layer did not change it (docs/results.md), so
this separates the graph's shape from everything else.

Every graph has ``--layers`` layers; a layer is a chain of ``--kernels`` tiny kernels (an in-place add on a small
tensor: launch-bound, like a decode step's small kernels) on the capture stream plus ``--side-kernels`` more that
the variants place differently:

- ``one-stream``: the side kernels inline, in the chain (the same nodes, no branch);
- ``join-per-layer`` / ``join-per-layer-high``: each layer forks them onto a side stream of default / highest
  priority and joins it before its next kernel (the whole-step graph's host write-back);
- ``join-at-end-high``: each layer forks onto a highest-priority stream, joined once at the end of the graph (the
  whole-step graph's selection jobs);
- ``two-side-high``: as ``join-at-end-high``, and each layer's branch forks onto a second such stream (a selection
  job and its gather).

Per variant: the host microseconds ``graph.replay()`` takes after a device synchronisation (median of
``--repeats``), the synchronised replay (host time plus the GPU's), and the replay when queued back to back. Writes
``<out>.json`` and ``<out>.md``; CUDA only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from eval._common import environment, finish, markdown_table, median, pipelined_ms, time_steps
from oasis_hf.cache.prefetch import background_stream

#: Variant name -> (where the side kernels go, the side stream's priority, where its branch joins).
VARIANTS = {
    "one-stream": ("inline", None, None),
    "join-per-layer": ("side", "default", "layer"),
    "join-per-layer-high": ("side", "highest", "layer"),
    "join-at-end-high": ("side", "highest", "end"),
    "two-side-high": ("two", "highest", "end"),
}


def build(variant: str, layers: int, kernels: int, side_kernels: int,
          device: torch.device) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """Capture one graph of `variant` (see the module docstring); returns it with the tensors its kernels add to
    (x: the chain's, y: the placed kernels', z: the second side stream's), which must outlive it."""
    where, priority, join = VARIANTS[variant]
    x = torch.zeros(64, device=device)
    y = torch.zeros(64, device=device)
    z = torch.zeros(64, device=device)
    side = (background_stream(device) if priority == "highest" else torch.cuda.Stream(device)) if priority else None
    second = background_stream(device) if where == "two" else None
    capture = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph()
    capture.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.graph(graph, stream=capture):
        compute = torch.cuda.current_stream(device)
        for _ in range(layers):
            for _ in range(kernels):
                x.add_(1)
            if where == "inline":
                for _ in range(side_kernels):
                    y.add_(1)
                continue
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                for _ in range(side_kernels):
                    y.add_(1)
            if second is not None:
                second.wait_stream(side)
                with torch.cuda.stream(second):
                    z.add_(1)
            if join == "layer":
                compute.wait_stream(side)
        if join == "end":
            compute.wait_stream(side)
            if second is not None:
                compute.wait_stream(second)
    torch.cuda.current_stream(device).wait_stream(capture)
    return graph, (x, y, z)


def measure(graph: torch.cuda.CUDAGraph, warmup: int, repeats: int) -> dict:
    """Host us of a replay after a synchronisation, the synchronised replay, and a replay queued back to back."""
    host_ms: list[float] = []
    synced_ms = time_steps(graph.replay, warmup, repeats, host_ms)
    queued_ms = pipelined_ms(graph.replay, repeats)
    return {"host us (replay call)": median(host_ms) * 1e3, "synchronised us": median(synced_ms) * 1e3,
            "queued us": queued_ms * 1e3}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kernels", type=int, default=16, help="kernels per layer on the capture stream")
    parser.add_argument("--side-kernels", type=int, default=1, help="kernels per layer the variants place")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variants (the order's effect)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("layers", "kernels", "rounds", "warmup", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.side_kernels < 1:
        parser.error("--side-kernels must be >= 1 (the variants differ in where these kernels run)")
    if not torch.cuda.is_available():
        parser.error("CUDA graphs need a CUDA device; this machine has none")
    env = environment()
    device = torch.device("cuda")
    built = {name: build(name, args.layers, args.kernels, args.side_kernels, device) for name in args.variants}
    rows = []
    for round_ in range(args.rounds):
        order = args.variants if round_ % 2 == 0 else list(reversed(args.variants))
        for name in order:
            nodes = args.layers * (args.kernels + args.side_kernels + (VARIANTS[name][0] == "two"))
            rows.append({"variant": name, "round": round_, "kernel nodes": nodes,
                         **measure(built[name][0], args.warmup, args.repeats)})
    columns = ["variant", "round", "kernel nodes", "host us (replay call)", "synchronised us", "queued us"]
    table = (f"{env.get('gpu')}, torch {env['torch']}; {args.layers} layers x ({args.kernels} kernels + "
             f"{args.side_kernels} placed by the variant); medians of {args.repeats} replays after {args.warmup}; "
             f"`{env['command']}`\n\n" + markdown_table(rows, columns))
    finish(args, table, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
