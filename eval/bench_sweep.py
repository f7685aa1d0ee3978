"""Decode sweep: step time and throughput of dense vs OasisKV over contexts, batch sizes and budgets, one run.

    python -m eval.bench_sweep --shape llama-8b --contexts 8192 32768 131072 --batches 1 8 --budgets 2048 \
        --host-gib 100 --out eval/results/sweep_8b

Every (context, batch) point runs dense `DynamicCache`, the graphed dense decode (`eval.dense_baselines`, one GPU:
the reference of "tokens/s vs dense") and each OasisKV selector on the same random-weight model of a real shape, with
the KV filled with random values through the Cache API (as in `eval.bench_multigpu`: no prefill
forward; `eval.bench_decode` measures prefill). A point that does not fit (dense K/V beyond the GPU's free memory,
OasisKV's host store beyond ``--host-gib``) is recorded as skipped with the reason, not silently dropped. Results are
written after every row (markdown + JSON), and PNG figures are drawn next to them: step time against context,
throughput against batch, GPU KV bytes per sequence against context.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from transformers import DynamicCache

import oasis_hf
from eval._common import code_identity, environment, markdown_table, write_results
from eval._harness import (
    GIB,
    SHAPES,
    kv_bytes_per_token_layer,
    parse_gpu_args,
    release_memory,
    run_method,
    split_model_for,
)
from eval.dense_baselines import dense_graphed_row
from eval.plot import pyplot_or_none, save_figure

logger = logging.getLogger("eval.bench_sweep")

COLUMNS = ["method", "context", "batch", "budget", "ms/step (median)", "ms/step (p90)", "tokens/s", "tokens/s vs dense",
           "tokens/s vs dense eager", "GPU KV MiB/seq", "host MiB/seq", "fetched blocks/layer-step", "skipped"]


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048])
    parser.add_argument("--selectors", nargs="+", default=["current-query", "lookahead", "static"])
    parser.add_argument("--host-gib", type=float, required=True, help="pinned host memory OasisKV may use")
    parser.add_argument("--whole-step", action="store_true",
                        help="also time each OasisKV selector with the whole forward as one CUDA graph (DecodeGraph)")
    parser.add_argument("--margin-gib", type=float, default=6.0, help="GPU memory kept free for activations")
    args = parse_gpu_args(parser)
    model, shape, dtype, devices = split_model_for(args.shape)
    per_token = kv_bytes_per_token_layer(shape, dtype) * shape["num_hidden_layers"]
    rows: list[dict] = []
    for context in args.contexts:
        capacity = -(-(context + 64) // 32) * 32
        for batch in args.batches:
            release_memory()
            free = min(torch.cuda.mem_get_info(d)[0] for d in devices) * len(devices)
            dense_need = per_token * capacity * batch * (1 + 1 / shape["num_hidden_layers"])
            point = dict(context=context, batch=batch)
            if dense_need > free - args.margin_gib * GIB:
                dense = dict(point, method="dense DynamicCache (sdpa)", budget="full",
                             skipped=f"K/V needs {dense_need / GIB:.0f} GiB, {free / GIB:.0f} GiB free")
            else:
                model.set_attn_implementation("sdpa")
                dense = dict(run_method(model, "dense DynamicCache (sdpa)", lambda: DynamicCache(config=model.config),
                                        batch, context, dtype, args.warmup, args.repeats), budget="full")
            rows.append(dense)
            # The strongest dense decode (one GPU): preallocated K/V, GQA-native SDPA, the forward one CUDA graph.
            reference = dense
            if len(devices) == 1 and "skipped" not in dense:
                release_memory()
                reference = dict(dense_graphed_row(model, batch, context, args.warmup, args.repeats), budget="full")
                rows.append(reference)
            report(args, shape, dtype, rows)
            host_need = per_token * capacity * batch
            variants = [(s, False) for s in args.selectors] + [(s, True) for s in args.selectors if args.whole_step]
            for budget in args.budgets:
                for selector, whole_step in variants:
                    label = f"OasisKV {selector}" + (" (whole-step CUDA graph)" if whole_step else "")
                    if host_need > args.host_gib * GIB:
                        rows.append(dict(point, method=label, budget=budget,
                                         skipped=f"host store needs {host_need / GIB:.0f} GiB > --host-gib"))
                        continue
                    cfg = oasis_hf.OasisConfig(budget_tokens=budget, selector=selector, host_capacity_tokens=capacity,
                                               host_memory_limit_bytes=int(args.host_gib * GIB))
                    model.set_attn_implementation("oasis")
                    try:
                        row = run_method(model, label, lambda cfg=cfg: oasis_hf.OasisCache(model.config, cfg), batch,
                                         context, dtype, args.warmup, args.repeats, whole_step)
                    except Exception as exc:  # noqa: BLE001 - recorded: one failing method must not lose the sweep
                        logger.exception("%s failed", label)
                        rows.append(dict(point, method=label, budget=budget, skipped=f"error: {exc!r}"[:200]))
                        continue
                    row["budget"] = budget
                    if "tokens/s" in reference:
                        row["tokens/s vs dense"] = row["tokens/s"] / reference["tokens/s"]
                    if "tokens/s" in dense:
                        row["tokens/s vs dense eager"] = row["tokens/s"] / dense["tokens/s"]
                    rows.append(row)
                    report(args, shape, dtype, rows)
            if "tokens/s" in reference:
                dense["tokens/s vs dense"] = dense["tokens/s"] / reference["tokens/s"]
                reference["tokens/s vs dense"] = 1.0
    report(args, shape, dtype, rows, final=True)


def report(args, shape: dict, dtype, rows: list[dict], final: bool = False) -> None:
    env = environment()
    header = (f"Test configuration: {env.get('gpus', 1)} x {env.get('gpu')}, torch {env['torch']}, transformers "
              f"{env['transformers']}, triton {env['triton']}; random-weight shape {args.shape} "
              f"({shape['num_hidden_layers']}L, {shape['num_key_value_heads']} KV heads), {dtype}; KV filled with "
              f"random values (no prefill forward); OasisKV host memory {args.host_gib} GiB; `{env['command']}`\n\n")
    table = header + markdown_table(rows, [c for c in COLUMNS if any(c in r for r in rows)])
    if final:
        print(table)
    if args.out is not None:
        payload = {"env": env, "config": vars(args) | {"out": str(args.out)}, "shape": shape, "rows": rows}
        write_results(args.out, payload, table)
        if final:
            plot_sweep(payload, args.out)


def plot_sweep(payload: dict, path: Path) -> list[Path]:
    """Three PNGs next to `path`: ms/step vs context (one line per method and batch), tokens/s vs batch (one line
    per method and context), GPU KV MiB per sequence vs context. Skipped points are left out of the lines."""
    plt = pyplot_or_none()
    if plt is None:
        return []
    rows = [r for r in payload["rows"] if "ms/step (median)" in r]
    rows = [dict(r, budget=r.get("budget", "full" if r["method"].startswith("dense") else "?")) for r in rows]
    methods = list(dict.fromkeys(f"{r['method']} @{r['budget']}" for r in rows))
    title = f"{payload['env'].get('gpu')} x{payload['env'].get('gpus', 1)}, {payload['config'].get('shape')}"
    made = []
    for name, x_key, series_key, y_key, ylabel, logy in [
        ("step_vs_context", "context", "batch", "ms/step (median)", "ms per decode step (median)", True),
        ("throughput_vs_batch", "batch", "context", "tokens/s", "decode tokens/s", True),
        ("gpu_kv_vs_context", "context", "batch", "GPU KV MiB/seq", "KV on the GPU per sequence (MiB)", True),
    ]:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for method in methods:
            for series in sorted({r[series_key] for r in rows}):
                pts = sorted((r[x_key], r[y_key]) for r in rows
                             if f"{r['method']} @{r['budget']}" == method and r[series_key] == series)
                if not pts:
                    continue
                style = "--" if method.startswith("dense") else "-"
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{method}, {series_key} {series}")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="best")
        made.append(save_figure(fig, plt, path.with_name(f"{path.name}_{name}.png")))
    return made


if __name__ == "__main__":  # `python -m eval.bench_sweep` runs the sweep; eval.plot redraws figures from JSON
    main()
