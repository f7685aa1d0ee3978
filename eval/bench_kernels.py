"""Kernel roofline check: achieved HBM bandwidth of the sparse attention kernel against a measured device copy.

    python -m eval.bench_kernels --out eval/results/kernels_h200

The decode-step attention reads every resident block once (K and V of ``budget`` tokens per sequence and KV head):
its useful bytes are ``2 * B * H_kv * budget * D * elem``. The kernel is checked against its PyTorch twin first, then
timed inside a CUDA graph (as the decode step runs it) with CUDA events; the reference bandwidth is an eager
device-to-device copy of 4 GiB (milliseconds long, so launch cost does not count) measured in the same run. Prints
a markdown table and writes JSON next to it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from eval._common import environment, finish, markdown_table, median
from eval.plot import plot_kernels
from oasis_hf.kernels import sparse_attention, sparse_attention_ref

logger = logging.getLogger("eval.bench_kernels")


def time_cuda(fn, warmup: int = 5, repeats: int = 20, per_graph: int = 20) -> float:
    """Median GPU milliseconds of one `fn()`: `per_graph` calls captured in a CUDA graph, replayed `repeats` times
    between CUDA events. The graph takes the host out (a Triton launch from Python costs more than a small kernel
    runs), as in the decode step, which replays these kernels inside its graph."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / per_graph)
    return median(times)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    ms = median(times)
    return 2 * nbytes / (ms / 1e3) / 1e9


def sparse_row(batch: int, kv_heads: int, q_heads: int, head_dim: int, budget: int, block: int, tokens: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = budget // block
    shape = (batch, kv_heads, slots, block, head_dim)
    pool_k = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    pool_v = torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen)
    query = torch.randn(batch, q_heads, tokens, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    seq_len = 32768
    # Resident blocks: a random set of distinct logical blocks per (sequence, head), including the newest.
    blocks = torch.rand(batch, kv_heads, seq_len // block, device="cuda", generator=gen).argsort(-1)[..., :slots]
    blocks[..., 0] = seq_len // block - 1
    slot_block = blocks.long()
    kv_start = torch.zeros(batch, dtype=torch.long, device="cuda")
    seq = torch.tensor(seq_len, device="cuda")
    scale = head_dim**-0.5
    out = sparse_attention(query, pool_k, pool_v, slot_block, seq, kv_start, scale)
    ref = sparse_attention_ref(query, pool_k, pool_v, slot_block, seq_len, kv_start, scale)
    err = (out.float() - ref.float()).abs().max().item()
    ms = time_cuda(lambda: sparse_attention(query, pool_k, pool_v, slot_block, seq, kv_start, scale))
    nbytes = 2 * pool_k.numel() * pool_k.element_size() + 2 * query.numel() * query.element_size()
    return {"kernel": "sparse_attention", "batch": batch, "H_kv": kv_heads, "H_q": q_heads, "D": head_dim,
            "budget": budget, "T": tokens, "us": ms * 1e3, "MB read": nbytes / 1e6,
            "GB/s": nbytes / (ms / 1e3) / 1e9, "max abs err vs twin": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="query tokens per step (1 + drafts)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    hbm = copy_bandwidth()
    rows = []
    for batch in args.batches:
        for budget in args.budgets:
            for tokens in args.tokens:  # Llama-3.1-8B attention shape: 32 query heads over 8 KV heads, D = 128
                row = sparse_row(batch, 8, 32, 128, budget, 32, tokens)
                row["% of copy bandwidth"] = 100 * row["GB/s"] / hbm
                rows.append(row)
    env = environment()
    header = (f"Test configuration: {env.get('gpu')}, torch {env['torch']}, triton {env['triton']}; bf16, block 32, "
              f"sequence length 32768; device-to-device copy bandwidth {hbm:.0f} GB/s (read + write, 4 GiB) in the "
              f"same run; `{env['command']}`\n\n")
    columns = ["kernel", "batch", "H_q", "H_kv", "D", "budget", "T", "us", "MB read", "GB/s", "% of copy bandwidth",
               "max abs err vs twin"]
    finish(args, header + markdown_table(rows, columns), {"env": env, "copy GB/s": hbm, "rows": rows}, plot_kernels)


if __name__ == "__main__":
    main()
