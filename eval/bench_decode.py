"""Decode-step benchmark: OasisCache against the fastest dense decode (graphed, `eval.dense_baselines`) and dense
`DynamicCache`, same model, same prompt, same run.

    python -m eval.bench_decode --preset core-8b-b8-32k --out eval/results/core_decode_8b_b8_32k

Random-weight models of real shapes (speed does not depend on the weights). Each method prefills the same prompt
and then times single-token decode steps (median and p90 over `repeats` steps after `warmup`); the graphed dense
row decodes over random K/V of the same context (its step does not depend on the values). "step vs dense" is
against that row, the strongest dense decode; "step vs dense eager" against `DynamicCache`. Prints a markdown
table and writes JSON (environment, config, exact command, raw times) next to it. `eval.bench_floor` runs the
acceptance points with every baseline and the byte floor.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import oasis_hf
from eval._common import code_identity, environment, markdown_table, median, percentile, time_steps, write_results
from eval._harness import LLAMA_8B, QWEN_7B, TINY, build_model
from eval.dense_baselines import dense_graphed_row
from eval.plot import plot_decode

logger = logging.getLogger("eval.bench_decode")


# A method is (label, OasisConfig overrides); "selectors" run with CUDA graphs and prefetch on (the defaults).
PRESETS = {
    # The acceptance run of the core issue: batch 8, 32k context, budget 2048, current-query selection.
    "core-8b-b8-32k": dict(shape=LLAMA_8B, batch=8, context=32512, host_capacity=32768, budget=2048,
                           selectors=["current-query", "static"],
                           extra=[("current-query", dict(cuda_graphs=False), "eager, no CUDA graphs")],
                           floor_context=2048, offload=False, warmup=3, repeats=20),
    # The lookahead issue: prefetch off the critical path, against the same step moving nothing (static) and HF's
    # own offloading. Plain decoding, so the lookahead queries are the previous step's (no drafts).
    "lookahead-8b-b8-32k": dict(shape=LLAMA_8B, batch=8, context=32512, host_capacity=32768, budget=2048,
                                selectors=["current-query", "lookahead", "static"],
                                extra=[("lookahead", dict(prefetch=False), "selection jobs inline"),
                                       ("lookahead", dict(prefetch_policy="stale"), "stale policy"),
                                       ("lookahead", dict(fetch_programs=None), "gather on every SM (uncapped)"),
                                       ("lookahead", dict(prefetch_launch="thread"),
                                        "jobs via the worker thread"),
                                       ("lookahead", dict(whole_step=True), "whole-step CUDA graph"),
                                       ("static", dict(whole_step=True), "whole-step CUDA graph")],
                                floor_context=None, offload=True, warmup=3, repeats=20),
    # Performance issue: one long sequence, where dense reads 16 GiB of KV per step and OasisKV 256 MiB.
    "b1-128k": dict(shape=LLAMA_8B, batch=1, context=130560, host_capacity=131072, budget=2048,
                    selectors=["current-query", "static"],
                    extra=[("current-query", dict(whole_step=True), "whole-step CUDA graph"),
                           ("lookahead", dict(whole_step=True), "whole-step CUDA graph")],
                    floor_context=None, offload=False, warmup=3, repeats=20),
    # The performance issue's second shape: GQA 7:1 (4 KV heads, so half the 8B's KV per token), same batch/context.
    "lookahead-qwen7b-b8-32k": dict(shape=QWEN_7B, batch=8, context=32512, host_capacity=32768, budget=2048,
                                    selectors=["current-query", "lookahead", "static"],
                                    extra=[("lookahead", dict(whole_step=True), "whole-step CUDA graph"),
                                           ("static", dict(whole_step=True), "whole-step CUDA graph")],
                                    floor_context=None, offload=False, warmup=3, repeats=20),
    "smoke": dict(shape=TINY, batch=2, context=1000, host_capacity=None, budget=256,
                  selectors=["current-query", "lookahead", "static"],
                  extra=[("lookahead", dict(whole_step=True), "whole-step CUDA graph")], floor_context=None,
                  offload=False, warmup=1, repeats=5),
}




@torch.inference_mode()
def run_method(model, name: str, make_cache, input_ids, warmup: int, repeats: int, profile_dir=None,
               whole_step: bool = False) -> dict:
    device = input_ids.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    cache = make_cache()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    t0 = time.perf_counter()
    out = model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    # GPU memory the prefill needed beyond the weights: activations, and the K/V that stays on the GPU (all of it for
    # dense; for OasisKV each layer's K/V is written to host as the layer finishes, so only the pool stays).
    prefill_peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if device.type == "cuda" else None
    token = out.logits[:, -1:].argmax(-1)
    runner = oasis_hf.DecodeGraph(model, cache) if whole_step else None

    def step():
        nonlocal token
        if runner is not None:  # the whole forward as one CUDA graph replay (no padding: positions = length)
            position = torch.full_like(token, cache.get_seq_length())
            logits = runner(token, position)
        else:
            logits = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1:].argmax(-1)

    enqueue: list[float] = []
    times = time_steps(step, warmup, repeats, enqueue)
    if profile_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        slug = "".join(c if c.isalnum() else "_" for c in name)
        text = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        text += "\n\nBy GPU time (kernels inside CUDA graphs may not be attributed):\n"
        text += prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
        launches = sum(evt.count for evt in prof.key_averages() if evt.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                                 "cuLaunchKernelEx"))
        profile_dir.mkdir(parents=True, exist_ok=True)
        (profile_dir / f"profile_{slug}.txt").write_text(f"kernel launches per step: {launches / 3:.0f}\n{text}")
    batch = input_ids.shape[0]
    row = {"method": name, "ms/step (median)": median(times), "ms/step (p90)": percentile(times, 0.9),
           "tokens/s": batch * 1e3 / median(times), "prefill s": prefill_s, "raw_ms": times}
    if prefill_peak is not None:
        row["prefill peak GiB"] = prefill_peak
    row["host enqueue ms/step"] = median(enqueue)
    if isinstance(cache, oasis_hf.OasisCache):
        stats = cache.stats.summary()  # waits for outstanding selection jobs
        row["fetched blocks/layer-step"] = stats["fetched_blocks_per_layer_step"]
        row["prefetch late jobs"] = stats["prefetch_late"]
        if cache.config.prefetch_policy == "stale":
            row["stale layer-steps"] = stats["stale_steps"]
        row["prefetch stall ms/step"] = stats["prefetch_stall_s"] * 1e3 / max(1, warmup + repeats)
        if stats["prefetch_jobs"]:  # where a job's host time goes: waiting for the worker (GIL), then running
            row["job queue wait us"] = stats["prefetch_queue_wait_s"] * 1e6 / stats["prefetch_jobs"]
            row["job host us"] = stats["prefetch_job_host_s"] * 1e6 / stats["prefetch_jobs"]
        layers = len(cache.oasis_layers)
        block_bytes = cache.host.bytes_per_block() // batch  # K + V of one (sequence, all heads) block
        heads = cache.oasis_layers[0].num_kv_heads
        moved = stats["fetched_blocks_per_layer_step"] * layers * block_bytes / heads
        row["PCIe MB/step"] = moved / 1e6
        row["GPU KV MiB/seq"] = cache.device_nbytes() / batch / 2**20
        row["host MiB/seq"] = cache.host_nbytes() / batch / 2**20
        row.update(graph_replay_cost(cache))
        row.update(gather_bandwidth(cache))
        cache.close()
    else:
        def nbytes(on_model_device: bool) -> int:  # offloaded layers sit on the CPU between uses
            return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers
                       if layer.keys is not None and (layer.keys.device == device) == on_model_device)
        row["GPU KV MiB/seq"] = nbytes(True) / batch / 2**20
        row["host MiB/seq"] = nbytes(False) / batch / 2**20

    return row


def graph_replay_cost(cache: oasis_hf.OasisCache, replays: int = 20) -> dict:
    """Host and device microseconds of one replay of layer 0's captured T=1 step (run last: it changes the cache)."""
    graphs = cache.oasis_layers[0].step_graphs.graphs
    if 1 not in graphs:
        return {}
    graph = graphs[1].graph
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    host_us = (time.perf_counter() - t0) * 1e6 / replays
    torch.cuda.synchronize()
    return {"graph replay host us": host_us, "graph replay GPU us": begin.elapsed_time(end) * 1e3 / replays}


def gather_bandwidth(cache: oasis_hf.OasisCache, repeats: int = 10) -> dict:
    """GB/s of the zero-copy delta gather as the cache runs it: `max_fetch_blocks` random blocks per (sequence,
    head) of layer 0 from pinned host memory into pool slots (run last: it overwrites pool contents)."""
    layer = cache.oasis_layers[0]
    if not layer.pool_k.is_cuda:
        return {}
    cfg = cache.config
    per_head = cfg.max_fetch_blocks or cfg.budget_blocks
    batch, heads = layer.batch_size, layer.num_kv_heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = torch.randint(0, layer.length // cfg.block_size, (batch, heads, per_head), device="cuda", generator=gen)
    slots = torch.arange(per_head, device="cuda").expand(batch, heads, -1)
    valid = torch.ones_like(blocks, dtype=torch.bool)
    cache.host.fetch(layer.layer_idx, blocks, layer.pool_k, layer.pool_v, slots, valid, cfg.kernel_backend)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        cache.host.fetch(layer.layer_idx, blocks, layer.pool_k, layer.pool_v, slots, valid, cfg.kernel_backend)
    end.record()
    torch.cuda.synchronize()
    nbytes = repeats * blocks.numel() * 2 * cfg.block_size * layer.head_dim * layer.pool_k.element_size()
    return {"gather GB/s": nbytes / (begin.elapsed_time(end) / 1e3) / 1e9}


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--out", type=Path, default=None, help="results path without suffix (.md and .json written)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="folder for a torch.profiler table per method. CUPTI stays attached after the first "
                             "profile and slows every later launch (graph replays ~9x), so time in a run without it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", type=int, nargs="*", default=None,
                        help="run only these OasisKV rows of the preset (0-based: its selectors, then its extras); "
                             "the dense row always runs")
    parser.add_argument("--no-offload", action="store_true", help="skip the HF offloading row")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    preset = PRESETS[args.preset]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    oasis_hf.register()
    model = build_model(preset["shape"], args.device, dtype)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, preset["shape"]["vocab_size"], (preset["batch"], preset["context"]), generator=gen)
    input_ids = input_ids.to(args.device)

    rows = []
    model.set_attn_implementation("sdpa")
    logger.info("dense DynamicCache ...")
    rows.append(run_method(model, "dense DynamicCache (sdpa)", lambda: DynamicCache(config=model.config), input_ids,
                           preset["warmup"], preset["repeats"], args.profile))
    if preset["floor_context"]:
        # The same forward at a short context: what a step costs when attention reads almost nothing (HF's floor).
        rows.append(run_method(model, f"dense DynamicCache (sdpa), {preset['floor_context']}-token context (floor)",
                               lambda: DynamicCache(config=model.config), input_ids[:, -preset["floor_context"]:],
                               preset["warmup"], preset["repeats"], None))
    if args.device == "cuda":
        logger.info("dense graphed ...")
        rows.append(dense_graphed_row(model, preset["batch"], preset["context"], preset["warmup"], preset["repeats"]))
    if preset["offload"] and not args.no_offload:
        logger.info("HF DynamicCache(offloading=True) ...")
        rows.append(run_method(model, "HF DynamicCache(offloading=True) (sdpa)",
                               lambda: DynamicCache(config=model.config, offloading=True), input_ids, 1, 3, None))
    model.set_attn_implementation("oasis")
    variants = [(s, {}, "") for s in preset["selectors"]] + list(preset["extra"])
    if args.only is not None:
        variants = [v for i, v in enumerate(variants) if i in args.only]
    for selector, overrides, note in variants:
        overrides = dict(overrides)
        whole_step = overrides.pop("whole_step", False)  # decode with oasis_hf.DecodeGraph, not model(...)
        cfg = oasis_hf.OasisConfig(budget_tokens=preset["budget"], selector=selector,
                                   host_capacity_tokens=preset["host_capacity"], **overrides)
        label = f"OasisKV {selector} @{preset['budget']}" + (f" ({note})" if note else "")
        logger.info("%s ...", label)
        try:
            rows.append(run_method(model, label, lambda cfg=cfg: oasis_hf.OasisCache(model.config, cfg), input_ids,
                                   preset["warmup"], preset["repeats"], args.profile, whole_step))
        except Exception as exc:  # noqa: BLE001 - recorded in the table: one failing method must not lose the others
            logger.exception("%s failed", label)
            rows.append({"method": label, "error": f"{type(exc).__name__}: {exc}"[:200]})
    eager_ms = rows[0]["ms/step (median)"]
    graphed = next((r for r in rows if r.get("kind") == "dense-graphed"), rows[0])
    dense_ms = graphed["ms/step (median)"]
    dense_kv = rows[0]["GPU KV MiB/seq"]
    static = next((r for r in rows if r["method"].startswith("OasisKV static")), None)
    offload = next((r for r in rows if "offloading" in r["method"]), None)
    for row in rows:
        if "error" in row:
            continue
        row["step vs dense"] = row["ms/step (median)"] / dense_ms
        row["step vs dense eager"] = row["ms/step (median)"] / eager_ms
        row["GPU KV vs dense"] = row["GPU KV MiB/seq"] / dense_kv
        if static is not None:  # the same step with nothing moving
            row["step vs static"] = row["ms/step (median)"] / static["ms/step (median)"]
        if offload is not None:
            row["tokens/s vs HF offloading"] = row["tokens/s"] / offload["tokens/s"]
    columns = ["method", "ms/step (median)", "ms/step (p90)", "tokens/s", "step vs dense", "step vs dense eager",
               "step vs static",
               "tokens/s vs HF offloading", "host enqueue ms/step", "GPU KV MiB/seq", "GPU KV vs dense",
               "host MiB/seq", "fetched blocks/layer-step", "PCIe MB/step", "gather GB/s", "prefetch late jobs",
               "stale layer-steps", "prefetch stall ms/step", "job queue wait us", "job host us",
               "graph replay host us", "graph replay GPU us",
               "prefill s", "prefill peak GiB", "error"]
    columns = [c for c in columns if any(c in row for row in rows)]
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers "
              f"{env['transformers']}, triton {env['triton']}; random-weight Llama shape "
              f"{preset['shape']['num_hidden_layers']}L/{preset['shape']['num_key_value_heads']}kv, "
              f"{dtype}, batch {preset['batch']}, context {preset['context']}, budget {preset['budget']}; "
              f"`{env['command']}`\n\n")
    if args.profile is not None:
        header += ("**Profiled run: every timing after the first method is inflated by the attached profiler; use "
                   "a run without `--profile` for speed.**\n\n")
    table = header + markdown_table(rows, columns)
    print(table)
    if args.out is not None:
        payload = {"env": env, "preset": args.preset, "config": {k: v for k, v in preset.items() if k != "shape"},
                   "shape": preset["shape"], "rows": rows}
        write_results(args.out, payload, table)
        plot_decode(payload, args.out)  # PNG next to the table when matplotlib is installed


if __name__ == "__main__":
    main()
