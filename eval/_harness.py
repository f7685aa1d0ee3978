"""What the benchmark scripts share: model shapes, random-weight models and their layer split over GPUs, random
K/V filling through the Cache API, the decode-step timer of one method, and the kernel-family profile of a step.

Scripts import this module, `eval._common` (environment, tables, result files) and the baselines
(`eval.dense_baselines`, `eval.press_baselines`), never one another.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
from accelerate import dispatch_model
from transformers import LlamaConfig, LlamaForCausalLM

import oasis_hf
from eval._common import median, percentile, time_steps

logger = logging.getLogger("eval._harness")

GIB = 2**30

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)

#: Qwen2.5-7B's attention and MLP sizes (GQA 7:1, 28 query heads over 4 KV heads) on the Llama architecture: the
#: decode step's bytes and FLOPs are those of Qwen2.5-7B (its q/k/v biases do not change them measurably).
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rope_theta=1000000.0)

#: Qwen2.5-Coder-1.5B's decode shape (the real pair's target) as a Llama: same layers, heads and widths; the q/k/v
#: biases it adds do not change the speed.
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                 tie_word_embeddings=True)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=8192)

SHAPES = {"llama-8b": LLAMA_8B, "qwen-7b": QWEN_7B, "qwen-1.5b": QWEN_1_5B, "tiny": TINY}


def build_model(shape: dict, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """A random-weight Llama of `shape` on `device` in `dtype`, in eval mode (speed does not depend on the weights)."""
    config = LlamaConfig(**shape)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


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


def split_model_for(shape_name: str, gpus: int | None = None, device: str = "cuda"):
    """The random-weight bf16 model of `shape_name`, layers split over the first `gpus` GPUs (default all), with the
    oasis attention registered; returns (model, shape dict, dtype, device names). ``device="cpu"``: a float32 model
    on the CPU alone (smoke runs of the plumbing)."""
    on_cpu = device == "cpu"
    devices = ["cpu"] if on_cpu else [f"cuda:{i}" for i in range(gpus or torch.cuda.device_count())]
    shape, dtype = SHAPES[shape_name], torch.float32 if on_cpu else torch.bfloat16
    oasis_hf.register()
    model, _ = split_by_layers(build_model(shape, devices[0], dtype), devices)
    return model, shape, dtype, devices


def parse_gpu_args(parser: argparse.ArgumentParser, cpu_smoke: bool = False) -> argparse.Namespace:
    """Add the options every GPU decode benchmark shares (timing, output), parse, set up logging, require CUDA;
    `cpu_smoke`: also ``--device cpu``, a smoke run of the plumbing on the CPU (tiny shape, nothing to measure)."""
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="results path without suffix (.md and .json written)")
    if cpu_smoke:
        parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                            help="cpu: a smoke run of the plumbing (tiny shape; needs --max-batch)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if getattr(args, "device", "cuda") == "cpu":
        args.shape = "tiny"
    elif not torch.cuda.is_available():
        parser.error("needs CUDA GPUs")
    return args


def layer_devices(model) -> list[torch.device]:
    return [next(layer.parameters()).device for layer in model.model.layers]


def kv_bytes_per_token_layer(shape: dict, dtype: torch.dtype) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_key_value_heads"] * head_dim * torch.empty((), dtype=dtype).element_size()


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


#: Kernel families of the profile table: the first pattern that matches a kernel's name wins.
FAMILIES = [
    ("weight GEMMs", r"gemm|cutlass|nvjet|xmma|cublas|splitK"),
    ("sparse attention", r"_sparse_attention_kernel"),
    ("attention split merge (+ the step's append)", r"_merge_splits_kernel|_merge_append_kernel"),
    ("append tokens (slots, pool, table, summaries)", r"_append_tokens_kernel"),
    ("host write-back", r"_write_tokens_kernel|_copy_rows_kernel"),
    ("block scoring", r"_stats_kernel|_scores_kernel|_score_blocks_kernel"),
    ("plan_blocks", r"_plan_blocks_kernel"),
    ("delta gather (PCIe)", r"_gather_blocks_kernel"),
    ("dense attention", r"flash|fmha|attention"),
    ("weight GEMMs in Inductor kernels (mm templates; mm as reductions, fused with norms)",
     r"^triton_tem_|^triton_(red|per)_fused\w*_mm_"),
    ("Inductor fused kernels (norms, RoPE, activations)", r"^triton_(poi|red|per)_"),
    ("other PyTorch kernels (norms, RoPE, activations, index, reduce, copies)", r"."),
]

def family(name: str) -> str:
    return next(label for label, pattern in FAMILIES if re.search(pattern, name))


def profile_families(step, layers: int, replays: int = 5) -> dict:
    """GPU microseconds per layer-step and kernel launches per layer-step, by kernel family, over `replays` steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            step()
        torch.cuda.synchronize()
    time_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            label = family(event.name)
            time_us[label] += event.device_time
            count[label] += 1
            kernels[event.name] += event.device_time
    per = replays * layers
    table = {label: {"us per layer-step": time_us[label] / per, "kernels per layer-step": count[label] / per}
             for label, _ in FAMILIES if label in time_us}
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"families": table, "top kernels (us per layer-step)": {name[:120]: t / per for name, t in top}}


@contextlib.contextmanager
def yarn_context(model, tokens: int):
    """The model's rotary embeddings stretched with YaRN to hold `tokens` positions while the block runs, as the
    Qwen2.5 model cards describe (``rope_type="yarn"``, ``factor`` the smallest power of two that covers `tokens`
    over the trained window, ``original_max_position_embeddings`` that window); nothing changes when `tokens` fits
    the window. The rotary modules are rebuilt from the changed config and the originals put back after, so rows at
    shorter lengths run the model as trained."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = config.max_position_embeddings
    if tokens <= window:
        yield 1.0
        return
    factor = 2.0
    while window * factor < tokens:
        factor *= 2
    saved = (dict(config.rope_parameters), window)
    rotary = [(parent, name, module) for parent in model.modules() for name, module in parent.named_children()
              if hasattr(module, "inv_freq") and hasattr(module, "rope_type")]
    if not rotary:
        raise ValueError(f"{type(model).__name__} has no rotary embedding module to stretch to {tokens} tokens")
    config.rope_parameters = {**saved[0], "rope_type": "yarn", "factor": factor,
                              "original_max_position_embeddings": window}
    config.max_position_embeddings = int(window * factor)
    try:
        for parent, name, module in rotary:
            setattr(parent, name, type(module)(config=config).to(module.inv_freq.device))
        logger.info("YaRN: rotary embeddings stretched %gx to %d positions", factor, config.max_position_embeddings)
        yield factor
    finally:
        config.rope_parameters, config.max_position_embeddings = saved
        for parent, name, module in rotary:
            setattr(parent, name, module)
