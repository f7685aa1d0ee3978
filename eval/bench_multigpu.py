"""Multi-GPU long-context decode: OasisKV against dense `DynamicCache` at the largest batch each method fits.

    python -m eval.bench_multigpu --contexts 65536 131072 --host-gib 224 --out eval/results/multigpu_8b_2gpu

A random-weight Llama-3.1-8B-shaped model is split by layers over the visible GPUs with accelerate's `device_map`
(the way users outgrow one GPU). Each method gets the largest batch it fits at each context:

- dense: every layer's K/V on its GPU, plus room for the copy `DynamicCache` makes when it appends (``torch.cat``)
  and a fixed margin for activations;
- OasisKV: the full K/V in pinned host memory (``--host-gib`` of it: the store is the limit), ``--budget`` tokens per
  sequence and layer on the GPUs.

The KV cache is filled with random K/V through the Cache API (no prefill forward: a 64k-128k prefill of dozens of
sequences would take minutes of GPU time and does not change the decode step), then single-token decode steps of
the whole model are timed (median and p90 after warm-up; every GPU synchronised around each step). Prints a markdown
table and writes JSON (environment, config, exact command) next to it.
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import DynamicCache

import oasis_hf
from eval._common import code_identity, environment, markdown_table, write_results
from eval._harness import (
    GIB,
    SHAPES,
    kv_bytes_per_token_layer,
    layer_devices,
    parse_gpu_args,
    release_memory,
    run_method,
    split_model_for,
)
from eval.plot import plot_throughput

logger = logging.getLogger("eval.bench_multigpu")


def dense_max_batch(model, shape, context: int, dtype, margin_gib: float) -> int:
    """Sequences whose K/V (+ one layer's append copy) fit in the free memory of every GPU."""
    per_seq_layer = kv_bytes_per_token_layer(shape, dtype) * (context + 64)
    devices = layer_devices(model)
    fits = []
    for device in sorted(set(devices), key=str):
        free, _ = torch.cuda.mem_get_info(device)
        layers_here = devices.count(device)
        fits.append(int((free - margin_gib * GIB) // (per_seq_layer * (layers_here + 1))))
    return max(0, min(fits))


def oasis_max_batch(shape, context: int, capacity: int, dtype, host_gib: float) -> int:
    per_seq = kv_bytes_per_token_layer(shape, dtype) * capacity * shape["num_hidden_layers"]
    return int(host_gib * GIB // per_seq)


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--budget", type=int, default=2048, help="OasisKV GPU tokens per sequence and layer")
    parser.add_argument("--selectors", nargs="+", default=["current-query", "lookahead"])
    parser.add_argument("--host-gib", type=float, required=True,
                        help="host memory OasisKV may pin (OasisConfig.host_memory_limit_bytes); also its batch limit")
    parser.add_argument("--margin-gib", type=float, default=6.0, help="GPU memory kept free for activations")
    parser.add_argument("--max-batch", type=int, default=None, help="cap every method's batch (smoke runs)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to split over (default: all visible)")
    args = parse_gpu_args(parser)
    model, shape, dtype, devices = split_model_for(args.shape, args.gpus)
    rows = []
    for context in args.contexts:
        capacity = -(-(context + 64) // 32) * 32
        release_memory()
        dense_batch = dense_max_batch(model, shape, context, dtype, args.margin_gib)
        oasis_batch = oasis_max_batch(shape, context, capacity, dtype, args.host_gib)
        if args.max_batch:
            dense_batch, oasis_batch = min(dense_batch, args.max_batch), min(oasis_batch, args.max_batch)
        logger.info("context %d: dense batch %d, OasisKV batch %d", context, dense_batch, oasis_batch)
        model.set_attn_implementation("sdpa")
        dense = run_method(model, "dense DynamicCache (sdpa)", lambda: DynamicCache(config=model.config),
                           dense_batch, context, dtype, args.warmup, args.repeats)
        rows.append(dense)
        dense["tokens/s vs dense"] = dense["GPU KV vs dense"] = 1.0
        report(args, devices, shape, dtype, rows)
        model.set_attn_implementation("oasis")
        for selector in args.selectors:
            cfg = oasis_hf.OasisConfig(budget_tokens=args.budget, selector=selector, host_capacity_tokens=capacity,
                                       host_memory_limit_bytes=int(args.host_gib * GIB))
            label = f"OasisKV {selector} @{args.budget}"
            logger.info("%s, context %d ...", label, context)
            row = run_method(model, label, lambda cfg=cfg: oasis_hf.OasisCache(model.config, cfg), oasis_batch,
                             context, dtype, args.warmup, args.repeats)
            rows.append(row)
            row["tokens/s vs dense"] = row["tokens/s"] / dense["tokens/s"]
            row["GPU KV vs dense"] = row["GPU KV MiB/seq"] / dense["GPU KV MiB/seq"]
            report(args, devices, shape, dtype, rows)  # after every row: a run cut short keeps what it measured


def report(args, devices: list[str], shape: dict, dtype, rows: list[dict]) -> None:
    columns = ["method", "context", "batch", "ms/step (median)", "ms/step (p90)", "tokens/s", "tokens/s vs dense",
               "host enqueue ms/step", "GPU KV MiB/seq", "GPU KV vs dense", "host MiB/seq",
               "fetched blocks/layer-step", "KV fill s"]
    env = environment()
    header = (f"Test configuration: {len(devices)} x {env.get('gpu')}, layers split with accelerate device_map, torch "
              f"{env['torch']}, transformers {env['transformers']}, triton {env['triton']}; random-weight Llama shape "
              f"{shape['num_hidden_layers']}L/{shape['num_key_value_heads']}kv, {dtype}; KV filled with random "
              f"values (no prefill forward); largest batch per method (dense: GPU memory; OasisKV: {args.host_gib} "
              f"GiB pinned host); budget {args.budget}; `{env['command']}`\n\n")
    table = header + markdown_table(rows, columns)
    print(table, flush=True)
    if args.out is not None:
        payload = {"env": env, "config": vars(args) | {"out": str(args.out), "devices": devices}, "shape": shape,
                   "rows": rows}
        write_results(args.out, payload, table)
        plot_throughput(payload, args.out)


if __name__ == "__main__":
    main()
