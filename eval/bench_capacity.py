"""Capacity under an HBM cap: the largest batch each method serves when its KV may use at most ``--kv-cap-gib`` of GPU
memory, and the decode throughput at that batch.

    python -m eval.bench_capacity --kv-cap-gib 24 --contexts 32768 --host-gib 100 --out eval/results/capacity_24g_32k

Dense `DynamicCache` needs the full K/V of every sequence on the GPU; OasisKV needs its block pool, summaries and
tables there (counted, not estimated: the row reports the bytes the cache holds), and the full K/V in pinned host
memory, which ``--host-gib`` bounds. Same model, fill and timing as `eval.bench_multigpu` (random Llama-3.1-8B-shaped
weights on the visible GPUs, KV filled with random values through the Cache API, whole-model decode steps).
"""

from __future__ import annotations

import argparse
import logging

from transformers import DynamicCache

import oasis_hf
from eval._common import code_identity, environment, finish, markdown_table
from eval._harness import (
    GIB,
    SHAPES,
    kv_bytes_per_token_layer,
    parse_gpu_args,
    release_memory,
    run_method,
    split_model_for,
)
from eval.plot import plot_throughput

logger = logging.getLogger("eval.bench_capacity")


def oasis_gpu_bytes_per_seq(shape: dict, cfg: oasis_hf.OasisConfig, capacity: int, dtype) -> int:
    """Pool (K and V of `budget_tokens`) + mean-key summaries (one key per block) + slot tables, all layers."""
    per_token = kv_bytes_per_token_layer(shape, dtype)
    blocks = capacity // cfg.block_size
    heads = shape["num_key_value_heads"]
    summaries = per_token // 2 * blocks
    tables = 8 * heads * (2 * cfg.budget_blocks + 1 + blocks)
    return shape["num_hidden_layers"] * (per_token * cfg.budget_tokens + summaries + tables)


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--kv-cap-gib", type=float, required=True, help="GPU memory the KV cache may use")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--selector", default="current-query")
    parser.add_argument("--host-gib", type=float, required=True, help="pinned host memory OasisKV may use")
    parser.add_argument("--max-batch", type=int, default=None, help="cap every method's batch (smoke runs)")
    args = parse_gpu_args(parser)
    model, shape, dtype, devices = split_model_for(args.shape)
    cap = int(args.kv_cap_gib * GIB)
    rows = []
    for context in args.contexts:
        capacity = -(-(context + 64) // 32) * 32
        cfg = oasis_hf.OasisConfig(budget_tokens=args.budget, selector=args.selector, host_capacity_tokens=capacity,
                                   host_memory_limit_bytes=int(args.host_gib * GIB))
        dense_seq = kv_bytes_per_token_layer(shape, dtype) * capacity * shape["num_hidden_layers"]
        oasis_seq = oasis_gpu_bytes_per_seq(shape, cfg, capacity, dtype)
        dense_batch = cap // dense_seq
        oasis_gpu_batch, oasis_host_batch = cap // oasis_seq, int(args.host_gib * GIB // dense_seq)
        oasis_batch = min(oasis_gpu_batch, oasis_host_batch)
        if args.max_batch:
            dense_batch, oasis_batch = min(dense_batch, args.max_batch), min(oasis_batch, args.max_batch)
        limit = "GPU cap" if oasis_gpu_batch <= oasis_host_batch else f"host memory ({args.host_gib} GiB)"
        logger.info("context %d: dense batch %d; OasisKV batch %d (limited by %s)", context, dense_batch, oasis_batch,
                    limit)
        release_memory()
        model.set_attn_implementation("sdpa")
        dense = run_method(model, "dense DynamicCache (sdpa)", lambda: DynamicCache(config=model.config),
                           dense_batch, context, dtype, args.warmup, args.repeats)
        model.set_attn_implementation("oasis")
        oasis = run_method(model, f"OasisKV {args.selector} @{args.budget}",
                           lambda cfg=cfg: oasis_hf.OasisCache(model.config, cfg), oasis_batch, context, dtype,
                           args.warmup, args.repeats)
        oasis["batch limited by"] = limit
        dense["batch limited by"] = "GPU cap"
        for row in (dense, oasis):
            row["GPU KV GiB (total)"] = row["GPU KV MiB/seq"] * row["batch"] / 1024
            row["host GiB (total)"] = row["host MiB/seq"] * row["batch"] / 1024
            row["batch vs dense"] = row["batch"] / dense["batch"]
            row["tokens/s vs dense"] = row["tokens/s"] / dense["tokens/s"]
            assert row["GPU KV GiB (total)"] <= args.kv_cap_gib + 1e-6, f"{row['method']} exceeds the KV cap"
        rows += [dense, oasis]
    env = environment()
    header = (f"Test configuration: {len(devices)} x {env.get('gpu')}, torch {env['torch']}, transformers "
              f"{env['transformers']}, triton {env['triton']}; random-weight Llama shape "
              f"{shape['num_hidden_layers']}L/{shape['num_key_value_heads']}kv, {dtype}; GPU KV cap "
              f"{args.kv_cap_gib} GiB, OasisKV host memory {args.host_gib} GiB, budget {args.budget}; KV filled with "
              f"random values (no prefill forward); `{env['command']}`\n\n")
    columns = ["method", "context", "batch", "batch limited by", "batch vs dense", "ms/step (median)", "tokens/s",
               "tokens/s vs dense", "GPU KV GiB (total)", "GPU KV MiB/seq", "host GiB (total)", "KV fill s"]
    finish(args, header + markdown_table(rows, columns), {"env": env, "shape": shape, "rows": rows}, plot_throughput)


if __name__ == "__main__":
    main()
