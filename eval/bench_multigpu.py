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
import contextlib
import gc
import logging
import time
from pathlib import Path

import torch
from accelerate import dispatch_model
from transformers import DynamicCache

import oasis_hf
from eval._common import code_identity, environment, markdown_table, median, percentile, time_steps, write_results
from eval.bench_decode import LLAMA_8B, QWEN_7B, TINY, build_model
from eval.plot import plot_throughput

logger = logging.getLogger("eval.bench_multigpu")

SHAPES = {"llama-8b": LLAMA_8B, "qwen-7b": QWEN_7B, "tiny": TINY}
GIB = 2**30


def split_by_layers(model, devices: list[str]):
    """Dispatch `model` with its decoder layers in equal consecutive runs over `devices` (accelerate hooks move the
    hidden states between them); embeddings on the first device, final norm and head on the last."""
    layers = model.config.num_hidden_layers
    device_map = {f"model.{name}": devices[0] for name, _ in model.model.named_children() if name != "layers"}
    device_map.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    for i in range(layers):
        device_map[f"model.layers.{i}"] = devices[i * len(devices) // layers]
    # main_device: modules mapped to "cpu" compute there (accelerate would otherwise treat them as offloaded
    # weights and run them on the first GPU).
    return dispatch_model(model, device_map=device_map, main_device=devices[0]), device_map


def parse_gpu_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Add the options every GPU decode benchmark shares (timing, output), parse, set up logging, require CUDA."""
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="results path without suffix (.md and .json written)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not torch.cuda.is_available():
        parser.error("needs CUDA GPUs")
    return args


def split_model_for(shape_name: str, gpus: int | None = None):
    """The random-weight bf16 model of `shape_name`, layers split over the first `gpus` GPUs (default all), with the
    oasis attention registered; returns (model, shape dict, dtype, device names)."""
    devices = [f"cuda:{i}" for i in range(gpus or torch.cuda.device_count())]
    shape, dtype = SHAPES[shape_name], torch.bfloat16
    oasis_hf.register()
    model, _ = split_by_layers(build_model(shape, devices[0], dtype), devices)
    return model, shape, dtype, devices


def layer_devices(model) -> list[torch.device]:
    return [next(layer.parameters()).device for layer in model.model.layers]


def kv_bytes_per_token_layer(shape: dict, dtype: torch.dtype) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_key_value_heads"] * head_dim * torch.empty((), dtype=dtype).element_size()


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


@torch.inference_mode()
def fill_random_kv(model, cache, batch: int, context: int, dtype, seed: int = 0) -> None:
    """Append `context` random K/V tokens per sequence to every layer of `cache` through the Cache API.

    An `OasisCache` layer also runs its prefill bookkeeping (host write-back, block summaries, first selection from
    one random query), as the attention of a prefill forward would."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for idx, device in enumerate(layer_devices(model)):
        on_gpu = device.type == "cuda"
        with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
            shape = (batch, config.num_key_value_heads, context, head_dim)
            layer_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
            keys = torch.randn(shape, dtype=dtype, device=device, generator=layer_gen)
            values = torch.randn(shape, dtype=dtype, device=device, generator=layer_gen)
            handle, values = cache.update(keys, values, idx)
            if isinstance(cache, oasis_hf.OasisCache):
                query = torch.randn(batch, config.num_attention_heads, 1, head_dim, dtype=dtype, device=device,
                                    generator=layer_gen)
                cache.layers[idx].attend(query, handle, values, None, head_dim**-0.5)
            del keys, values, handle
            if on_gpu:
                torch.cuda.synchronize(device)  # the write-back of this layer is done: its K/V memory can be reused


def release_memory() -> None:
    """Return the previous method's cached GPU blocks, so free memory (and the batch that fits) is what is left."""
    gc.collect()
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


@torch.inference_mode()
def run_method(model, label: str, make_cache, batch: int, context: int, dtype, warmup: int, repeats: int,
               whole_step: bool = False) -> dict:
    """Time decode steps after filling the KV; `whole_step`: through `oasis_hf.DecodeGraph` (one device)."""
    release_memory()
    cache = make_cache()
    t0 = time.perf_counter()
    fill_random_kv(model, cache, batch, context, dtype)
    fill_s = time.perf_counter() - t0
    logger.info("  KV filled in %.1f s; timing %d + %d steps", fill_s, warmup, repeats)
    first = layer_devices(model)[0]
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=first)
    runner = oasis_hf.DecodeGraph(model, cache) if whole_step else None

    def step():
        nonlocal token
        if runner is not None:  # the whole forward as one CUDA graph replay (no padding: positions = length)
            logits = runner(token, torch.full_like(token, cache.get_seq_length()))
        else:
            logits = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1:].argmax(-1).to(first)

    enqueue: list[float] = []
    times = time_steps(step, warmup, repeats, enqueue)
    row = {"method": label, "context": context, "batch": batch, "ms/step (median)": median(times),
           "ms/step (p90)": percentile(times, 0.9), "tokens/s": batch * 1e3 / median(times),
           "host enqueue ms/step": median(enqueue), "KV fill s": fill_s, "raw_ms": times,
           "peak GPU GiB": [torch.cuda.max_memory_allocated(i) / GIB for i in range(torch.cuda.device_count())]}
    if isinstance(cache, oasis_hf.OasisCache):
        stats = cache.stats.summary()
        row["GPU KV MiB/seq"] = cache.device_nbytes() / batch / 2**20
        row["host MiB/seq"] = cache.host_nbytes() / batch / 2**20
        row["fetched blocks/layer-step"] = stats["fetched_blocks_per_layer_step"]
        row["graph replays"] = stats["graph_replays"]
        cache.close()
    else:
        kv = sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers if layer.keys is not None)
        row["GPU KV MiB/seq"] = kv / batch / 2**20
        row["host MiB/seq"] = 0.0
    return row


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
