"""Multi-GPU long-context decode: OasisKV against dense graphed and dense `DynamicCache`, each at the largest batch
it fits.

    python -m eval.bench_multigpu --contexts 65536 131072 --host-gib 224 --out eval/results/multigpu_8b_2gpu

A random-weight Llama-3.1-8B-shaped model is split by layers over the visible GPUs with accelerate's `device_map`
(the way users outgrow one GPU). Each method gets the largest batch it fits at each context:

- dense (``kind`` ``dense-eager``): `DynamicCache`, every layer's K/V on its GPU, plus room for the copy it makes
  when it appends (``torch.cat``) and a fixed margin for activations;
- dense graphed (``dense-graphed``, the reference of the ratios): preallocated K/V on each layer's GPU, SDPA with
  ``enable_gqa`` over the valid prefix, every decoder layer one CUDA graph replay on its own device
  (`eval.dense_baselines.dense_layer_graphed_row`: PyTorch cannot capture one graph across GPUs), its logits
  checked against the same step without graphs; no append copy, so it fits more sequences than `DynamicCache`;
- OasisKV (``oasis-<selector>``): the full K/V in pinned host memory (``--host-gib`` of it: the store is the limit),
  ``--budget`` tokens per sequence and layer on the GPUs, decoded through the per-layer path (each layer's step a
  CUDA graph under the model's eager modules; `oasis_hf.DecodeGraph`'s whole-step graph captures one device).

The KV cache is filled with random K/V through the Cache API (no prefill forward: a 64k-128k prefill of dozens of
sequences would take minutes of GPU time and does not change the decode step), then single-token decode steps of
the whole model are timed (median and p90 after warm-up; every GPU synchronised around each step). Rows carry
``method``, ``kind``, ``context``, ``batch`` and ``tokens_per_s``. Prints a markdown table and writes JSON
(environment, config, exact command) next to it.
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
from eval.dense_baselines import dense_layer_graphed_row
from eval.plot import plot_throughput

logger = logging.getLogger("eval.bench_multigpu")


def dense_max_batch(model, shape, context: int, dtype, margin_gib: float, append_copy: bool = True) -> int:
    """Sequences whose K/V fit in the free memory of every GPU; `append_copy`: plus one layer's copy, which
    `DynamicCache` makes when it appends (``torch.cat``); preallocated buffers (dense graphed) need none."""
    per_seq_layer = kv_bytes_per_token_layer(shape, dtype) * (context + 64)
    devices = layer_devices(model)
    fits = []
    for device in sorted(set(devices), key=str):
        free, _ = torch.cuda.mem_get_info(device)
        layers_here = devices.count(device)
        fits.append(int((free - margin_gib * GIB) // (per_seq_layer * (layers_here + int(append_copy)))))
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
    args = parse_gpu_args(parser, cpu_smoke=True)
    on_cpu = args.device == "cpu"
    if on_cpu and not args.max_batch:
        parser.error("--device cpu needs --max-batch (the batches come from GPU memory otherwise)")
    model, shape, dtype, devices = split_model_for(args.shape, args.gpus, args.device)
    rows = []
    for context in args.contexts:
        capacity = -(-(context + 64) // 32) * 32
        release_memory()
        dense_batch = args.max_batch if on_cpu else dense_max_batch(model, shape, context, dtype, args.margin_gib)
        oasis_batch = oasis_max_batch(shape, context, capacity, dtype, args.host_gib)
        if args.max_batch:
            dense_batch, oasis_batch = min(dense_batch, args.max_batch), min(oasis_batch, args.max_batch)
        logger.info("context %d: dense batch %d, OasisKV batch %d", context, dense_batch, oasis_batch)
        model.set_attn_implementation("sdpa")
        dense = run_method(model, "dense DynamicCache (sdpa)", lambda: DynamicCache(config=model.config),
                           dense_batch, context, dtype, args.warmup, args.repeats) | {"kind": "dense-eager"}
        rows.append(dense)
        dense["tokens/s vs dense eager"] = dense["GPU KV vs dense"] = 1.0
        report(args, devices, shape, dtype, rows)
        release_memory()
        graphed_batch = args.max_batch if on_cpu else dense_max_batch(model, shape, context, dtype, args.margin_gib,
                                                                      append_copy=False)
        if args.max_batch:
            graphed_batch = min(graphed_batch, args.max_batch)
        logger.info("dense graphed, context %d, batch %d ...", context, graphed_batch)
        graphed = dense_layer_graphed_row(model, graphed_batch, context, args.warmup, args.repeats)
        rows.append(graphed)
        graphed["tokens/s vs dense eager"] = graphed["tokens/s"] / dense["tokens/s"]
        graphed["tokens/s vs dense graphed"] = 1.0
        graphed["GPU KV vs dense"] = graphed["GPU KV MiB/seq"] / dense["GPU KV MiB/seq"]
        report(args, devices, shape, dtype, rows)
        model.set_attn_implementation("oasis")
        for selector in args.selectors:
            cfg = oasis_hf.OasisConfig(budget_tokens=args.budget, selector=selector, host_capacity_tokens=capacity,
                                       host_memory_limit_bytes=int(args.host_gib * GIB))
            label = f"OasisKV {selector} @{args.budget}"
            logger.info("%s, context %d ...", label, context)
            row = run_method(model, label, lambda cfg=cfg: oasis_hf.OasisCache(model.config, cfg), oasis_batch,
                             context, dtype, args.warmup, args.repeats)
            row["kind"] = f"oasis-{selector}"
            rows.append(row)
            row["tokens/s vs dense graphed"] = row["tokens/s"] / graphed["tokens/s"]
            row["tokens/s vs dense eager"] = row["tokens/s"] / dense["tokens/s"]
            row["GPU KV vs dense"] = row["GPU KV MiB/seq"] / dense["GPU KV MiB/seq"]
            report(args, devices, shape, dtype, rows)  # after every row: a run cut short keeps what it measured


def report(args, devices: list[str], shape: dict, dtype, rows: list[dict]) -> None:
    for row in rows:
        if "tokens/s" in row:
            row["tokens_per_s"] = row["tokens/s"]
    columns = ["method", "kind", "context", "batch", "ms/step (median)", "ms/step (p90)", "tokens/s",
               "tokens/s vs dense graphed", "tokens/s vs dense eager",
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
