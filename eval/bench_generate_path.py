"""The path users take: ``model.generate`` over an `OasisCache` against the `DecodeGraph` replay it stands on, and
OasisKV's prefill against dense prefill, on the same model in one process.

    python -m eval.bench_generate_path --points 8x32512 --prefill-points 8x32512 \
        --out eval/results/generate_path_h200

A random-weight Llama-3.1-8B-shaped model (bf16). Rows (``rows`` of the JSON):

- ``{"kind": "decode", "path", "batch", "context", "ms_per_step"}`` for each selector (``--selectors``):
  ``DecodeGraph`` (one whole-step graph replay per step, called directly, synchronised per step),
  ``model.generate`` (greedy, routed to the same graph by `oasis_hf.enable`, the queued loop:
  `OasisConfig.queued_generate`), ``model.generate (transformers' loop)`` (``queued_generate=False``: a device
  synchronisation per step), ``model.generate (per-layer)`` (``whole_step=False``: the model's eager modules around
  per-layer graphs) and ``dense graphed`` (`eval.dense_baselines`, the reference of the fused-step benchmark).
  The K/V are random (no prefill forward); ``model.generate`` gets the cached tokens plus one as ``input_ids``, so
  its first forward is already a decode step. A step of ``model.generate`` is the time between consecutive calls
  of a stopping criterion (transformers' loop synchronises once per step; the queued loop stays at most one step
  ahead of the device); ``host ms/step`` is the host time of the queued loop's steps, from ``cProfile`` (top
  functions in the JSON).
- ``{"kind": "prefill", "method": "dense" | "oasis", "batch", "context", "seconds"}``: one forward over a random
  prompt (``logits_to_keep=1``), dense with transformers' `DynamicCache` and SDPA, OasisKV with a fresh cache whose
  host store is allocated and page-locked during the prefill (``oasis``, what a first ``generate`` call pays) and
  with its host buffer taken from a warm `PinnedPool` (``oasis, warm host pool``); the peak GPU memory each needed
  beyond the weights; and both again with the prompt in ``--prefill-chunk`` chunks (what ``generate(...,
  prefill_chunk_size=N)`` does), which bounds that memory.
- ``{"kind": "pin"}``: page-locking ``--pin-gib`` GiB of host memory, by method (what a fresh host store costs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import oasis_hf
from eval._common import (
    PROFILE_CHILD_FLAG,
    code_identity,
    environment,
    markdown_table,
    median,
    merge_profiles,
    percentile,
    profiles_from_child,
    synchronize,
    time_steps,
    write_results,
)
from eval._harness import SHAPES, build_model, fill_random_kv, profile_families, release_memory
from eval.dense_baselines import GIB, dense_graphed_row
from oasis_hf import compat
from oasis_hf.cache.pinned import PinnedBuffer, PinnedPool

logger = logging.getLogger("eval.bench_generate_path")

COLUMNS = ["kind", "path", "method", "selector", "batch", "context", "ms_per_step", "ms/step (p90)",
           "vs DecodeGraph", "host ms/step (profiled)", "seconds", "host s", "vs dense", "peak GiB", "GB/s", "note"]


class StepClock(StoppingCriteria):
    """A stopping criterion that never stops and stamps the time of every call (once per generation step)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_ms(self, warmup: int) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(self.stamps[warmup:], self.stamps[warmup + 1 :], strict=False)]


def _filled_cache(model, cfg: oasis_hf.OasisConfig, pool: PinnedPool, batch: int, context: int):
    cache = oasis_hf.OasisCache(model.config, cfg, host_pool=pool)
    fill_random_kv(model, cache, batch, context, next(model.parameters()).dtype)
    return cache


def _profile_host(fn) -> tuple[float, list[dict]]:
    """Host seconds of `fn` and its 25 functions of most own time (file:line:function, ms)."""
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    fn()
    profiler.disable()
    elapsed = time.perf_counter() - t0
    stats = pstats.Stats(profiler, stream=io.StringIO())
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]  # (file, line, name) -> (cc, nc, tt, ct, ...)
    return elapsed, [{"function": f"{Path(f).name}:{line}:{name}", "calls": nc, "own ms": tt * 1e3,
                      "cumulative ms": ct * 1e3} for (f, line, name), (_, nc, tt, ct, _) in top]


@torch.inference_mode()
def decode_rows(model, selector: str, pool: PinnedPool, batch: int, context: int, warmup: int, repeats: int,
                max_fetch: int | None, compiled: bool = False) -> list[dict]:
    """The DecodeGraph, model.generate and per-layer rows of one selector; `compiled`: the first two with
    `OasisConfig.compile_model` (paths suffixed ``(compile_model)``; the per-layer path, which compiles nothing, is
    left out)."""
    device = next(model.parameters()).device
    fields = dict(budget_tokens=2048 if context > 4096 else 256, selector=selector, compile_model=compiled,
                  host_capacity_tokens=context + 4 * (warmup + repeats) + 64)
    suffix = " (compile_model)" if compiled else ""
    if max_fetch is not None:
        fields["max_fetch_blocks"] = max_fetch
    base = dict(kind="decode", selector=selector, batch=batch, context=context)
    rows = []
    model.set_attn_implementation("oasis")
    token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)

    # DecodeGraph, called directly.
    release_memory()
    with _filled_cache(model, oasis_hf.OasisConfig(**fields), pool, batch, context) as cache:
        runner = oasis_hf.DecodeGraph(model, cache)
        state = {"token": token}

        def step():
            logits = runner(state["token"], torch.full_like(state["token"], cache.get_seq_length()))
            state["token"] = logits[:, -1:].argmax(-1)

        times = time_steps(step, warmup, repeats)
    rows.append(base | {"path": "DecodeGraph" + suffix, "ms/step (median)": median(times), "ms/step (p90)":
                        percentile(times, 0.9), "raw_ms": times})

    # model.generate: the whole-step graph through oasis_hf.enable's forward wrapper, then the per-layer path.
    paths = [("model.generate", True, True), ("model.generate (transformers' loop)", True, False)]
    paths += [] if compiled else [("model.generate (per-layer)", False, True)]
    for path, whole, queued in paths:
        release_memory()
        cfg = oasis_hf.OasisConfig(**fields, whole_step=whole, queued_generate=queued)
        with _filled_cache(model, cfg, pool, batch, context) as cache:
            ids = torch.randint(0, model.config.vocab_size, (batch, context + 1), device=device)
            clock = StepClock()

            def generate(ids, steps, clock=clock, cache=cache):
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      **{compat.cache_kwarg(model): cache},
                                      max_new_tokens=steps, do_sample=False,
                                      stopping_criteria=StoppingCriteriaList([clock]))

            generate(ids, warmup + repeats + 1)
            times = clock.step_ms(warmup)
            host_s, top = (None, [])
            if whole and queued:  # where the loop's host time goes, over `repeats` more steps on the same graph
                cache.reset()
                fill_random_kv(model, cache, batch, context, next(model.parameters()).dtype)
                out = generate(ids, warmup + 1)  # continued below: the cache holds its tokens
                synchronize()
                host_s, top = _profile_host(lambda out=out: generate(out, repeats))
        row = base | {"path": path + suffix, "ms/step (median)": median(times), "ms/step (p90)": percentile(times, 0.9),
                      "raw_ms": times}
        if host_s is not None:
            row["host ms/step (profiled)"] = host_s * 1e3 / repeats
            row["host profile (top own time)"] = top
        rows.append(row)
    graph = rows[0]["ms/step (median)"]
    for row in rows:
        row["ms_per_step"] = row["ms/step (median)"]
        row["vs DecodeGraph"] = row["ms_per_step"] / graph
    return rows


@torch.inference_mode()
def prefill_rows(model, pool: PinnedPool, batch: int, context: int, profile: bool = False,
                 chunk: int | None = None) -> list[dict]:
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    cfg = oasis_hf.OasisConfig(budget_tokens=2048 if context > 4096 else 256, selector="lookahead")
    rows = []

    def run(method: str, make_cache, attn: str, note: str = "", chunk: int | None = None,
            length: int = context) -> dict:
        release_memory()
        model.set_attn_implementation(attn)
        weights = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        cache = make_cache()
        synchronize()
        t0 = time.perf_counter()
        for a in range(0, length, chunk or length):  # transformers' prefill_chunk_size does the same
            model(ids[:, a : min(length, a + (chunk or length))], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        host = time.perf_counter() - t0
        if isinstance(cache, oasis_hf.OasisCache):
            cache.wait()  # the selection and the host write-back of the last layer
        synchronize()
        seconds = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - weights) / GIB if device.type == "cuda" else None
        if isinstance(cache, oasis_hf.OasisCache):
            cache.close()
        del cache
        return {"kind": "prefill", "method": method, "batch": batch, "context": context, "seconds": seconds,
                "host s": host, "peak GiB": peak, "note": note}

    # Load every kernel once before timing, dense and OasisKV alike at the timed shapes (OasisKV's Triton kernels
    # specialise on shapes, the first run compiles them; dense gets the same chance at its first-shape costs), then
    # release OasisKV's host buffer (the next run is cold).
    pooled = lambda: oasis_hf.OasisCache(model.config, cfg, host_pool=pool)  # noqa: E731
    for make, attn in ((DynamicCache, "sdpa"), (pooled, "oasis")):  # dense too at the timed shapes (cuBLAS, allocator)
        run("warm-up", make, attn)
        if chunk and chunk < context:  # and the shapes of a chunk after the first
            run("warm-up", make, attn, chunk=chunk, length=min(context, 2 * chunk))
    pool.clear()
    rows.append(run("dense", DynamicCache, "sdpa", "DynamicCache, sdpa"))
    rows.append(run("oasis", pooled, "oasis", "fresh cache: its host store is allocated and page-locked during the "
                    "prefill (closing it hands the buffer to the pool)"))
    rows.append(run("oasis, warm host pool", pooled, "oasis", "host buffer taken from the PinnedPool"))
    if chunk and chunk < context:  # bounded GPU memory: the prompt in chunks over the same cache
        rows.append(run(f"dense, chunks of {chunk}", DynamicCache, "sdpa", "DynamicCache, sdpa", chunk))
        rows.append(run(f"oasis, chunks of {chunk}", pooled, "oasis", "warm host pool; each chunk attends over the "
                        "earlier tokens read back from host", chunk))
    if profile and device.type == "cuda":  # GPU time by kernel, one prefill each
        for row, attn, make in ((rows[0], "sdpa", DynamicCache), (rows[-1], "oasis", pooled)):
            model.set_attn_implementation(attn)
            cache = make()
            row["profile"] = profile_families(
                lambda cache=cache: model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1),
                model.config.num_hidden_layers, replays=1)
            if isinstance(cache, oasis_hf.OasisCache):
                cache.close()
            del cache
            release_memory()
    dense = rows[0]["seconds"]
    for row in rows:
        row["vs dense"] = row["seconds"] / dense
    return rows


def pin_rows(gib: float) -> list[dict]:
    """Seconds to page-lock `gib` GiB: ``cudaHostRegister`` of fresh pages, `PinnedBuffer` (pages touched, then
    locked, per range), and torch's ``cudaHostAlloc``."""
    nbytes = int(gib * GIB)
    rows = []

    def timed(method, fn):
        t0 = time.perf_counter()
        keep = fn()
        seconds = time.perf_counter() - t0
        rows.append({"kind": "pin", "method": method, "seconds": seconds, "GB/s": nbytes / seconds / 1e9})
        del keep

    def fresh():
        data = torch.empty(nbytes, dtype=torch.uint8)
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), nbytes, 3))
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(data.data_ptr()))
        return data

    timed("cudaHostRegister of fresh pages, one range", fresh)
    timed("PinnedBuffer, one range (touch, then register)", lambda: PinnedBuffer(nbytes, pin=True))
    timed(f"PinnedBuffer, {nbytes // (GIB // 2)} ranges of 512 MiB", lambda: PinnedBuffer(nbytes, pin=True,
                                                                                          chunk_bytes=GIB // 2))
    timed("cudaHostAlloc (torch.empty(pin_memory=True))", lambda: torch.empty(nbytes, dtype=torch.uint8,
                                                                              pin_memory=True))
    return rows


def main() -> None:
    code_identity()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--points", nargs="*", default=["8x32512"], help="BATCHxCONTEXT decode points")
    parser.add_argument("--prefill-points", nargs="*", default=["8x32512"], help="BATCHxCONTEXT prefill points")
    parser.add_argument("--selectors", nargs="+", default=["static", "lookahead"])
    parser.add_argument("--max-fetch-blocks", type=int, default=5,
                        help="lookahead's cap per (seq, head, layer-step); 5: the real model's rate (eval.delta_rate)")
    parser.add_argument("--pin-gib", type=float, default=8.0, help="GiB for the page-locking rows (0: none)")
    parser.add_argument("--prefill-chunk", type=int, default=8192,
                        help="also prefill in chunks of this many tokens (0: no chunked rows)")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="GPU time by kernel of one prefill each, taken in a child process after the timings")
    parser.add_argument("--compile-model", choices=["off", "also"], default="off",
                        help="also: the DecodeGraph / model.generate rows and the dense graphed row once more with the "
                             "model through torch.compile (OasisConfig.compile_model)")
    parser.add_argument(PROFILE_CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)  # profiles_from_child
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    oasis_hf.register()
    on_gpu = args.device.startswith("cuda")
    if not on_gpu:
        args.shape = "tiny"  # a smoke run of the plumbing
    # Timings never follow a profiler session in their process: with --profile-prefill on the GPU this process times
    # and a child process (the same arguments) profiles the prefills, and only them.
    profile_child = args.profile_prefill and on_gpu and not args.profile_in_process
    if args.profile_in_process:
        args.points, args.pin_gib = [], 0
    shape = SHAPES[args.shape]
    model = build_model(shape, args.device, torch.bfloat16 if on_gpu else torch.float32)
    oasis_hf.enable(model)
    model.generation_config.eos_token_id = None  # random weights: every run generates its full length
    model.generation_config.pad_token_id = 0
    pool = PinnedPool()
    rows: list[dict] = []
    env = environment()

    def save() -> str:
        table = (f"Test configuration: {env.get('gpu')}, torch {env['torch']}, transformers {env['transformers']}; "
                 f"random-weight {args.shape} shape, {'bf16' if on_gpu else 'fp32 (CPU smoke run)'}; OasisKV budget "
                 f"2048; lookahead max_fetch_blocks={args.max_fetch_blocks}; medians of {args.repeats} steps after "
                 f"{args.warmup}; `{env['command']}`\n\n"
                 + markdown_table(rows, [c for c in COLUMNS if any(c in r for r in rows)]))
        if args.out is not None:
            write_results(args.out, {"env": env, "config": vars(args) | {"out": str(args.out)}, "shape": shape,
                                     "rows": rows}, table)
        return table

    def attempt(label: str, fn) -> None:
        logger.info("%s ...", label)
        try:
            rows.extend(fn())
        except Exception as exc:  # noqa: BLE001 - recorded: one failing section must not lose the others
            logger.exception("%s failed", label)
            rows.append({"kind": "error", "method": label, "note": f"{type(exc).__name__}: {exc}"[:300]})
        release_memory()
        save()

    if on_gpu and args.pin_gib:
        attempt("page-locking", lambda: pin_rows(args.pin_gib))
    profile_here = args.profile_prefill and not profile_child
    for text in args.prefill_points:
        batch, context = (int(x) for x in text.lower().split("x"))
        attempt(f"prefill {text}", lambda b=batch, c=context: prefill_rows(model, pool, b, c, profile_here,
                                                                                  args.prefill_chunk))
        pool.clear()
    for text in args.points:
        batch, context = (int(x) for x in text.lower().split("x"))
        variants = [False, True] if args.compile_model == "also" else [False]
        for selector in args.selectors:
            cap = args.max_fetch_blocks if selector == "lookahead" else None
            for compiled in variants:
                attempt(f"decode {text} {selector}{' compiled' if compiled else ''}",
                        lambda b=batch, c=context, s=selector, cap=cap, k=compiled: decode_rows(
                            model, s, pool, b, c, args.warmup, args.repeats, cap, compiled=k))
        for compiled in variants if on_gpu else []:
            path = "dense graphed" + (" (torch.compile)" if compiled else "")
            attempt(f"{path} {text}", lambda b=batch, c=context, k=compiled, p=path: [
                dense_graphed_row(model, b, c, args.warmup, args.repeats, compiled=k) | {"kind": "decode", "path": p}
            ])
        pool.clear()
    if profile_child:
        del model  # the child loads its own
        release_memory()
        with tempfile.TemporaryDirectory() as tmp:
            child = profiles_from_child("eval.bench_generate_path", sys.argv[1:], Path(tmp))
        merge_profiles(rows, child, key=("kind", "method", "batch", "context"))
    for row in rows:
        if "ms/step (median)" in row:
            row["ms_per_step"] = row["ms/step (median)"]
    print(save())


if __name__ == "__main__":
    main()
