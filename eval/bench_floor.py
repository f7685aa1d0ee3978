"""Decode at the byte floor: OasisKV's whole-step graph against the fastest dense decode, side by side.

    python -m eval.bench_floor --points 8x32512 1x130560 16x32512 --compile-points 8x32512 \
        --delta-rate eval/results/delta_rate_qwen1.5b_16k.json --out eval/results/floor_h200

A random-weight Llama-3.1-8B-shaped model (bf16; speed does not depend on the weights). Every point (batch x context)
runs all of its rows in this one process, the K/V filled with random values (no prefill forward):

- ``dense-graphed`` (`eval.dense_baselines`): preallocated K/V, SDPA with ``enable_gqa`` over the valid prefix (and
  our Triton split-K kernel over every block), the whole forward one CUDA graph; its logits checked against eager
  dense attention; the faster of the two is the reference every ratio is taken against;
- ``dense-eager`` (`DynamicCache`) and ``dense-compile`` (`StaticCache` + ``torch.compile``, at ``--compile-points``);
- ``floor``: the bytes a step must read over the copy bandwidth measured at the start of the run, for dense and for
  OasisKV at the budget (resident K/V plus one read of the block summaries for the selectors that score); each
  fetching OasisKV row also carries its ``PCIe floor ms``: the delta it moved per step over the host-to-device copy
  bandwidth measured at the start of the run (a step is no faster than the larger of its two floors, since a
  selection job's transfer finishes inside the step that forks it);
- ``oasis-static``, ``oasis-lookahead``, ``oasis-current-query``: `oasis_hf.DecodeGraph` replays (one CUDA graph per
  step, the lookahead selection jobs forked onto the prefetch stream inside it). Random K/V make every step's
  selection new, so lookahead moves its ``max_fetch_blocks`` cap (16 per sequence, KV head and layer) every step;
  ``oasis-lookahead`` at the real-model rate replays, as the cap, the blocks per layer-step Qwen2.5-Coder-1.5B's
  lookahead moved at 16k in plain decoding (one token per forward, like these steps; ``--delta-rate``, from
  `eval.delta_rate`, whose drafted rows the note quotes).

With ``--compile-model also`` (the default) the dense-graphed (SDPA) row and every OasisKV row also run with the
model through ``torch.compile`` inside the captured graph (Inductor fuses the norms, RoPE and activations around the
attention, which eagerly are about 30 small kernels per layer-step): ``dense graphed (sdpa, torch.compile)`` and
``OasisKV ... (whole-step graph, torch.compile)`` (`OasisConfig.compile_model`). Rows carry ``compiled``; the step
ratio against static compares like with like; ``compile + capture s`` is the time the first steps took.

``--fetch-programs 8 16`` runs the fetching OasisKV rows once per cap on the delta gather's programs
(`OasisConfig.fetch_programs`: fewer programs hold fewer SMs beside the step, more move the delta faster), in the
same process, each row labelled with its cap. ``python -m eval.bench_floor --compare BEFORE.json AFTER.json OUT.md``
sets two runs' profiles side by side; ``python -m eval.bench_floor --combine OUT RUN.json ...`` writes one results
file (JSON, table, figure) from several runs, e.g. one process per point, each row tagged with its run.

``--config FIELD=VALUE ...`` sets `OasisConfig` fields of every OasisKV row (e.g. the accuracy suite's selection
setting: ``block_size=16 sink_tokens=16 recent_tokens=64 summary=mean+minmax``); the rows' labels carry them and the
sparse floor reads the summaries they keep. ``--variant NAME FIELD=VALUE ...`` (repeatable) runs every OasisKV row
once more with those fields on top, in the same process, labelled ``[NAME: ...]``, with a sparse floor of its own
and its step compared with its own static row (with the base static row when the variant sets
``selection_interval``, which static selection does not take). A lookahead row at the real-model rate replays the
rate times ``selection_interval`` per job (the same bytes per step: an upper bound), unless the variant sets
``max_fetch_blocks`` (the one field a variant may set that ``--config`` may not).

``--isolate`` runs every method of every point in a process of its own (this script, the same arguments, that point
and method alone), so that no row is timed after another in its process; the parent computes the floor rows (its
model on the meta device) and the ratios. Every timed row records the ``pid`` of its process either way.

With ``--profile``, the OasisKV static and lookahead rows and the graphed dense row of the profiled points also get a
kernel-family table (torch.profiler over replays: microseconds of GPU time per layer-step by family). The profiles
are taken in a child process run with the same arguments once the timings are done: after a torch.profiler session
CUPTI stays attached to its process and every later launch there is slower, so no timed step follows one.
Writes ``<out>.json`` (rows of ``method, kind, batch, context, ms_per_step`` plus the measurements), ``<out>.md`` and
``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import oasis_hf
from eval._common import (
    PROFILE_CHILD_FLAG,
    child_rows,
    code_identity,
    config_fields,
    environment,
    markdown_table,
    median,
    merge_profiles,
    percentile,
    pipelined_ms,
    profiles_from_child,
    time_steps,
    write_results,
)
from eval._harness import FAMILIES, SHAPES, build_model, fill_random_kv, profile_families, release_memory
from eval.dense_baselines import (
    GIB,
    check_dense_graphed,
    compile_label,
    dense_compile_row,
    dense_eager_row,
    dense_graphed_row,
    floor_ms,
    graphed_label,
    h2d_bandwidth,
    hbm_bandwidth,
    kv_bytes_per_token,
)
from eval.plot import plot_floor
from oasis_hf.cache.pinned import PinnedPool
from oasis_hf.config import blocks_for
from oasis_hf.kernels.ref import summary_key_vectors

logger = logging.getLogger("eval.bench_floor")

#: OasisConfig fields ``--config`` may not set: the rows, the point and the other flags set them.
RESERVED = ("budget_tokens", "selector", "host_capacity_tokens", "max_fetch_blocks", "sync_fetch_blocks",
            "fetch_programs", "compile_model", "compile_mode", "measure_recall")
#: The flag of an ``--isolate`` run's children (`isolated_point`); hidden from --help.
ISOLATED_FLAG = "--isolated-child"

METHODS = ("dense-eager", "dense-graphed", "dense-compile", "oasis-static", "oasis-lookahead", "oasis-current-query",
           "oasis-lookahead-real")
COLUMNS = ["method", "kind", "batch", "context", "ms_per_step", "ms/step (p90)", "tokens/s",
           "speed-up vs dense graphed", "step vs static", "vs dense eager", "host enqueue ms/step",
           "ms/step (no per-step sync)", "GPU KV MiB/seq",
           "host MiB/seq", "fetched blocks/(seq, head, layer-step)", "PCIe GB/s", "delta MB/step", "PCIe floor ms",
           "note"]


#: --compile-model: which variants of the dense-graphed (sdpa) and OasisKV rows run (model through torch.compile).
COMPILED = {"off": [False], "also": [False, True], "only": [True]}


def compile_variants(args) -> list[tuple[bool, str | None]]:
    """(compiled, torch.compile mode) of each variant of the dense-graphed (sdpa) and OasisKV rows."""
    modes = [None if mode == "default" else mode for mode in args.compile_modes]
    return [(compiled, mode) for compiled in COMPILED[args.compile_model] for mode in (modes if compiled else [None])]


def fetch_program_variants(args) -> list[dict]:
    """The config fields of each variant of the fetching OasisKV rows: ``[{}]`` (the library's `fetch_programs`)
    without ``--fetch-programs``, else ``{"fetch_programs": value}`` per value given (``none``: no cap)."""
    return [{"fetch_programs": None if value == "none" else int(value)} for value in args.fetch_programs or []] or [{}]


def parse_point(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def delta_rate(path: Path | None, task: str | None = None) -> tuple[float | None, str, int | None]:
    """The blocks per (sequence, KV head) and layer-step to replay: the highest of an `eval.delta_rate` result's
    plain-decoding rows (one token per forward, as the benchmark's steps), of `task`'s rows only when given; a
    note with the drafted rows' rate per forward and per token; and the block size it was measured at (its
    ``oasis_config``; None if the file does not say)."""
    if path is None:
        return None, "", None
    payload = json.loads(Path(path).read_text())
    # A job after every forward only (rows of other `selection_interval`s measure a job's delta, not a step's).
    rows = [r for r in payload["rows"] if (task is None or r.get("task") == task)
            and r.get("selection_interval", 1) == 1]
    if not rows:
        raise SystemExit(f"--delta-rate {path}: no rows of task {task!r}")
    plain = [r["blocks/(seq, head, forward)"] for r in rows if "plain decoding" in r["method"]]
    drafted = [r for r in rows if "draft model" in r["method"]]
    measured = payload.get("config", {})
    variant = " ".join(measured.get("config") or [])  # `eval.delta_rate --config`, e.g. keep_margin=0.5
    note = (f"{measured.get('model', 'the measured model')}'s lookahead"
            + (f" ({variant})" if variant else "")
            + (f" moved {max(plain):.2f} blocks per (seq, head, layer-step) at {measured['context']} tokens in plain "
               "decoding" if plain and "context" in measured else "")
            + "".join(f"; with the draft model ({r['task']}): {r['blocks/(seq, head, forward)']:.2f} per forward "
                      f"of {r['forwards'] and r['new tokens'] / r['forwards']:.1f} tokens, "
                      f"{r['blocks/(seq, head, token)']:.2f} per token" for r in drafted))
    return (max(plain) if plain else None), note, payload.get("oasis_config", {}).get("block_size")


def selector_of(method: str) -> str:
    """The `OasisConfig.selector` of an ``oasis-...`` method."""
    return {"oasis-lookahead-real": "lookahead"}.get(method, method.removeprefix("oasis-"))


@torch.inference_mode()
def oasis_row(model, kind: str, cfg: oasis_hf.OasisConfig, pool: PinnedPool, batch: int, context: int,
              warmup: int, repeats: int, profile: bool, h2d: float) -> dict:
    """Fill an OasisCache with random K/V, then time `oasis_hf.DecodeGraph` replays of one-token steps (the first
    steps of the warm-up run eagerly, compile when `cfg.compile_model`, and capture). `h2d`: the host-to-device copy
    bandwidth (bytes/s) the row's PCIe floor divides its delta by."""
    release_memory()
    model.set_attn_implementation("oasis")
    with oasis_hf.OasisCache(model.config, cfg, host_pool=pool) as cache:
        t0 = time.perf_counter()
        fill_random_kv(model, cache, batch, context, next(model.parameters()).dtype)
        fill_s = time.perf_counter() - t0
        device = next(model.parameters()).device
        token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
        runner = oasis_hf.DecodeGraph(model, cache)

        def step():
            nonlocal token
            logits = runner(token, torch.full_like(token, cache.get_seq_length()))
            token = logits[:, -1:].argmax(-1)

        t0 = time.perf_counter()
        for _ in range(3 if cfg.compile_model else 2):  # eager (compiling), [recompiling,] capturing
            step()
        capture_s = time.perf_counter() - t0
        enqueue: list[float] = []
        times = time_steps(step, warmup, repeats, enqueue)
        stats = cache.stats.summary()
        queued = pipelined_ms(step, repeats)  # after the statistics: they cover the synchronised steps only
        layer = cache.oasis_layers[0]
        pairs = layer.batch_size * layer.num_kv_heads
        fetched = stats["fetched_blocks_per_layer_step"]
        block_bytes = cache.host.bytes_per_block() // pairs  # K + V of one (sequence, head) block
        moved = fetched * block_bytes * len(cache.oasis_layers)
        graph = f"whole-step graph{compile_label(cfg.compile_model, cfg.compile_mode)}"
        # With a job every Nth step the steps alternate between two graphs: the median of such a mix is one of
        # them, the mean over whole cycles (``repeats`` a multiple of N) is the throughput.
        typical = median(times) if cfg.selection_interval == 1 else sum(times) / len(times)
        row = {"method": f"OasisKV {cfg.selector} @{cfg.budget_tokens} ({graph})", "kind": kind,
               "compiled": cfg.compile_model, "compile mode": cfg.compile_mode, "compile + capture s": capture_s,
               "context": context, "batch": batch, "ms/step (median)": median(times),
               "ms/step (mean)": sum(times) / len(times), "selection_interval": cfg.selection_interval,
               "ms/step (p90)": percentile(times, 0.9), "tokens/s": batch * 1e3 / typical,
               "host enqueue ms/step": median(enqueue), "ms/step (no per-step sync)": queued,
               "GPU KV MiB/seq": cache.device_nbytes() / batch / 2**20,
               "host MiB/seq": cache.host_nbytes() / batch / 2**20,
               "fetched blocks/(seq, head, layer-step)": fetched / pairs,
               "PCIe GB/s": moved / (typical / 1e3) / 1e9 if fetched else 0.0,
               "delta MB/step": moved / 1e6, "PCIe floor ms": 1e3 * moved / h2d,
               "fetch_programs": cfg.fetch_programs, "max_fetch_blocks": cfg.max_fetch_blocks,
               "block_size": cfg.block_size, "summary": cfg.summary,
               "prefetch late jobs": stats["prefetch_late"], "KV fill s": fill_s,
               "raw_ms": times}
        if profile:
            row["profile"] = profile_families(step, len(cache.oasis_layers))
    if cfg.compile_model:
        torch.compiler.reset()
    return row


def run_point(model, args, batch: int, context: int, bandwidth: float, h2d: float, pool: PinnedPool,
              rate: float | None, rate_note: str = "") -> list:
    rows: list[dict] = []
    point = f"{batch}x{context}"
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 2**62
    dense_bytes = batch * (context + 64) * kv_bytes_per_token(model)

    def attempt(fn, label: str, kind: str):
        logger.info("%s: %s ...", point, label)
        try:
            row = fn()
        except Exception as exc:  # noqa: BLE001 - recorded: one failing method must not lose the others
            logger.exception("%s failed", label)
            row = {"method": label, "kind": kind, "batch": batch, "context": context,
                   "error": f"{type(exc).__name__}: {exc}"[:300]}
        row["pid"] = os.getpid()  # rows with one pid ran in one process, in the order listed
        rows.append(row)
        release_memory()
        return row

    fits = dense_bytes + 8 * GIB < free
    dense_skip = f"dense K/V needs {dense_bytes / GIB:.0f} GiB, {free / GIB:.0f} GiB free"
    if "dense-eager" in args.methods:
        if fits and dense_bytes * (1 + 1 / model.config.num_hidden_layers) + 8 * GIB < free:
            attempt(lambda: dense_eager_row(model, batch, context, args.warmup, args.repeats), "dense eager",
                    "dense-eager")
        else:
            rows.append({"method": "dense eager (DynamicCache, sdpa)", "kind": "dense-eager", "batch": batch,
                         "context": context, "note": dense_skip})
    if "dense-graphed" in args.methods:
        variants = [(kernel, compiled, mode) for kernel in args.dense_kernels
                    for compiled, mode in compile_variants(args)
                    if kernel == "sdpa" or not compiled]  # the Triton-kernel variant runs uncompiled only
        for kernel, compiled, mode in variants:
            label = graphed_label(kernel, compiled, mode)
            if not fits:
                rows.append({"method": label, "kind": "dense-graphed", "batch": batch, "context": context,
                             "note": dense_skip})
                continue
            profile = None
            if args.profile_here and point in args.profile_points and kernel == "sdpa" and torch.cuda.is_available():
                profile = lambda step: profile_families(step, model.config.num_hidden_layers)  # noqa: E731
            row = attempt(lambda k=kernel, p=profile, c=compiled, m=mode: dense_graphed_row(
                model, batch, context, args.warmup, args.repeats, k, p, compiled=c, mode=m), label, "dense-graphed")
            row["logit check"] = check_dense_graphed(model, batch, min(context, args.check_context), kernel,
                                                     compiled=compiled, mode=mode)
            logger.info("  check: %s", row["logit check"])
    if "dense-compile" in args.methods and point in args.compile_points and fits and torch.cuda.is_available():
        attempt(lambda: dense_compile_row(model, batch, context, args.warmup, args.repeats), "dense compile",
                "dense-compile")
    host_capacity = context + 64
    configs = []
    for variant, extra in args.variants.items():
        for method in args.methods:
            if not method.startswith("oasis-"):
                continue
            selector = selector_of(method)
            fields = (dict(budget_tokens=args.budget, selector=selector, host_capacity_tokens=host_capacity)
                      | args.config | extra)
            if method == "oasis-static" and int(fields.get("selection_interval", 1)) > 1:
                continue  # static selection runs no jobs: the variant's rows compare with the base static row
            if method == "oasis-lookahead-real":
                if rate is None:
                    continue
                # A row of another block size moves the measured rate's bytes: blocks scaled by the size ratio. A
                # job every Nth forward moves N steps' worth, an upper bound (blocks chosen at two of those steps
                # move once; the 0.5B at 4k moved 1.08x, not 2x, a single step's delta per job at N = 2).
                # A variant that sets max_fetch_blocks replays that cap instead (e.g. a measured per-job delta).
                block = int(fields.get("block_size", oasis_hf.OasisConfig.block_size))
                scale = (args.rate_block_size or block) / block * int(fields.get("selection_interval", 1))
                if "max_fetch_blocks" not in extra:
                    fields["max_fetch_blocks"] = max(1, math.ceil(rate * scale))
            # Static selection moves nothing: one row at the library's cap; the others one per --fetch-programs.
            caps = [{}] if method == "oasis-static" else fetch_program_variants(args)
            # The lookahead rows also run with each --sync-fetch-blocks correction (on random KV the step's own
            # queries disagree with the job's at every step: each correction fetches its full cap, the upper bound).
            syncs = [0, *args.sync_fetch_blocks] if selector == "lookahead" else [0]
            for (compiled, mode), cap, sync in [(v, c, n) for v in compile_variants(args) for c in caps for n in syncs]:
                configs.append((method, oasis_hf.OasisConfig(**fields, **cap, compile_model=compiled,
                                                             compile_mode=mode, sync_fetch_blocks=sync),
                                len(caps) > 1, variant))
    for method, cfg, labelled, variant in configs:
        kind = "oasis-lookahead" if method == "oasis-lookahead-real" else method
        profile = (args.profile_here and point in args.profile_points and torch.cuda.is_available()
                   and method in ("oasis-static", "oasis-lookahead", "oasis-lookahead-real"))
        row = attempt(lambda cfg=cfg, kind=kind, profile=profile: oasis_row(
            model, kind, cfg, pool, batch, context, args.warmup, args.repeats, profile, h2d), method, kind)
        if labelled:
            row["method"] += f", fetch_programs={cfg.fetch_programs}"
        if method == "oasis-lookahead-real":
            per = "layer-step" if cfg.selection_interval == 1 else f"job, one per {cfg.selection_interval} steps"
            row["method"] += f", real-model delta rate ({cfg.max_fetch_blocks} blocks per (seq, head, {per}))"
            row["note"] = f"max_fetch_blocks={cfg.max_fetch_blocks}: {rate_note}"
            if args.rate_block_size and args.rate_block_size != cfg.block_size:
                row["note"] += (f"; measured with blocks of {args.rate_block_size}, replayed here as the same bytes "
                                f"in blocks of {cfg.block_size}")
        if cfg.sync_fetch_blocks:
            row["method"] += f", sync_fetch_blocks={cfg.sync_fetch_blocks}"
        if args.config:
            row["method"] += ", " + config_label(args.config)
        if variant:
            row["method"] += f" [{variant}: {config_label(args.variants[variant])}]"
        row["variant"] = variant
    rows += all_floor_rows(model, args, batch, context, bandwidth)
    annotate(rows)
    return rows


def config_label(fields: dict) -> str:
    """``--config`` fields as a row label: ``block_size=16 summary=mean+minmax``."""
    return " ".join(f"{name}={value}" for name, value in fields.items())


def all_floor_rows(model, args, batch: int, context: int, bandwidth: float) -> list[dict]:
    """The dense floor, and a sparse floor for --config and for each --variant (their summaries differ)."""
    rows = floor_rows(model, args.budget, batch, context, bandwidth, args.config)
    for variant, extra in args.variants.items():
        if variant:
            sparse = floor_rows(model, args.budget, batch, context, bandwidth, args.config | extra)[1]
            rows.append(sparse | {"method": f"{sparse['method']} [{variant}]", "variant": variant})
    return rows


def floor_rows(model, budget: int, batch: int, context: int, bandwidth: float,
               fields: dict | None = None) -> list[dict]:
    """The floor: weights + the K/V each method attends over (+ one read of the summaries for scoring selectors) at
    `bandwidth`, the summaries those of `OasisConfig(**fields)`. `model` may live on the meta device: only its
    parameter sizes and config are read."""
    # Only the summary and its block size set the floor (other fields may need a selector this default lacks).
    shape = {name: value for name, value in (fields or {}).items() if name in ("summary", "block_size")}
    config = oasis_hf.OasisConfig(budget_tokens=budget, **shape)
    # Per block, layer and KV head, each summary vector (mean key, lower and upper bound) takes one token's key bytes,
    # a quantized summary's codes an eighth of them per token (bf16 keys).
    vectors = summary_key_vectors(config.summary, config.block_size)
    summary_bytes = int(batch * blocks_for(context, config.block_size) * vectors * kv_bytes_per_token(model) // 2)
    return [{"method": "floor, dense", "kind": "floor", "batch": batch, "context": context,
             "ms/step (median)": floor_ms(model, batch, context + 1, bandwidth)},
            {"method": f"floor, sparse @{budget} (+ {config.summary} summaries of blocks of {config.block_size} "
                       "read once)", "kind": "floor", "batch": batch,
             "context": context, "ms/step (median)": floor_ms(model, batch, budget, bandwidth, summary_bytes)}]


def isolated_point(model, args, batch: int, context: int, bandwidth: float) -> list[dict]:
    """One point with every method in a process of its own (``--isolate``): a child runs this benchmark with the
    same arguments for this point and that method alone; the floor and the ratios are the parent's."""
    rows: list[dict] = []
    for method in args.methods:
        with tempfile.TemporaryDirectory() as tmp:
            child = child_rows("eval.bench_floor", sys.argv[1:], Path(tmp),
                               ["--points", f"{batch}x{context}", "--methods", method, ISOLATED_FLAG])
        rows += [row for row in child if row.get("kind") != "floor"]
    rows += all_floor_rows(model, args, batch, context, bandwidth)
    annotate(rows)
    return rows


def annotate(rows: list[dict]) -> None:
    """Ratios within one point: against the fastest dense-graphed row, eager dense, and the static OasisKV step."""
    def best(kind):
        times = [r["ms/step (median)"] for r in rows if r.get("kind") == kind and "ms/step (median)" in r]
        return min(times) if times else None

    graphed, eager = best("dense-graphed"), best("dense-eager")
    static = {(r.get("compiled", False), r.get("compile mode"), r.get("variant", "")): r["ms/step (median)"]
              for r in rows if r.get("kind") == "oasis-static" and "ms/step (median)" in r}
    for row in rows:
        if "ms/step (median)" not in row:
            continue
        # The median step; the mean over whole job cycles for a row whose jobs run every Nth step only.
        ms = row["ms_per_step"] = row["ms/step (mean)" if row.get("selection_interval", 1) > 1 else "ms/step (median)"]
        if graphed:
            row["speed-up vs dense graphed"] = graphed / ms
        if eager:
            row["vs dense eager"] = eager / ms
        # The static step of the same compile variant and --variant (the base one where the variant has none).
        key = (row.get("compiled", False), row.get("compile mode"))
        same = static.get((*key, row.get("variant", ""))) or static.get((*key, ""))
        if same and row.get("kind", "").startswith("oasis"):
            row["step vs static"] = ms / same


def report(args, shape: dict, bandwidth: float, h2d: float, rows: list[dict], final: bool = False) -> str:
    env = environment()
    precision = ("bf16" if args.device.startswith("cuda")
                 else "fp32, a CPU smoke run (no graphs, no timing worth reading)")
    header = (f"Test configuration: {env.get('gpu')}, torch {env['torch']}, transformers {env['transformers']}, triton "
              f"{env['triton']}; random-weight {args.shape} shape ({shape['num_hidden_layers']} layers, "
              f"{shape['num_key_value_heads']} KV heads), {precision}; KV filled with random values (no prefill "
              "forward); "
              f"OasisKV budget {args.budget} tokens ({config_label(args.config) or 'library defaults'}); "
              "device-to-device copy "
              f"bandwidth {bandwidth / 1e12:.2f} TB/s and host-to-device (pinned, copy engine) {h2d / 1e9:.1f} "
              f"GB/s measured in this run; medians of {args.repeats} steps after "
              f"{args.warmup}; `{env['command']}`\n\n")
    table = header + markdown_table(rows, [c for c in COLUMNS if any(c in r for r in rows)])
    if any("profile" in r for r in rows):
        table += "\n\n" + profile_table(rows)
    if args.out is not None:
        payload = {"env": env, "config": vars(args) | {"out": str(args.out)}, "shape": shape,
                   "hbm_bytes_per_s": bandwidth, "h2d_bytes_per_s": h2d, "rows": rows}
        write_results(args.out, payload, table)
        if final:
            plot_floor(payload, args.out)
    return table


def _profile_cell(entry: dict | None) -> str:
    return "" if entry is None else f"{entry['us per layer-step']:.1f} ({entry['kernels per layer-step']:.1f})"


def profile_table(rows: list[dict]) -> str:
    """The kernel-family table (GPU us and kernels per layer-step) of the rows that carry a profile."""
    profiles = [r for r in rows if "profile" in r]
    labels = [label for label, _ in FAMILIES if any(label in r["profile"]["families"] for r in profiles)]
    names = [f"{r['kind']}{' compiled' if r.get('compiled') else ''}"
             f"{' ' + r['compile mode'] if r.get('compile mode') else ''} {r['batch']}x{r['context']}"
             for r in profiles]
    where = ", in a separate process from the timings" if any("profile process" in r for r in rows) else ""
    lines = [f"GPU time per layer-step by kernel family (torch.profiler, 5 replays{where}; us, kernels):", "",
             "| family | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label in labels:
        cells = [_profile_cell(r["profile"]["families"].get(label)) for r in profiles]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    totals = [sum(v["us per layer-step"] for v in r["profile"]["families"].values()) for r in profiles]
    lines.append("| total GPU time | " + " | ".join(f"{t:.1f}" for t in totals) + " |")
    return "\n".join(lines)


def compare_profiles(before: dict, after: dict) -> str:
    """Markdown: GPU us per layer-step by kernel family (kernels per layer-step), and ms per step, of each profiled
    OasisKV row of `before` next to the same row (kind, batch, context) of `after`."""
    def profiled(payload):
        return {(r["kind"], r["batch"], r["context"]): r for r in payload["rows"]
                if "profile" in r and r["kind"].startswith("oasis")}

    old, new = profiled(before), profiled(after)
    keys = [k for k in old if k in new]
    names = [f"{kind.removeprefix('oasis-')} {batch}x{context} {when}" for kind, batch, context in keys
             for when in ("before", "after")]
    lines = ["| family | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    pairs = [(old[k], new[k]) for k in keys]
    for label, _ in FAMILIES:
        cells = [_profile_cell(r["profile"]["families"].get(label)) for pair in pairs for r in pair]
        if any(cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    totals = [sum(v["us per layer-step"] for v in r["profile"]["families"].values()) for pair in pairs for r in pair]
    lines.append("| total GPU time (us per layer-step) | " + " | ".join(f"{t:.0f}" for t in totals) + " |")
    steps = [r["ms_per_step"] for pair in pairs for r in pair]
    lines.append("| **step (ms, median)** | " + " | ".join(f"**{t:.2f}**" for t in steps) + " |")
    return "\n".join(lines)


def combine(out: Path, runs: list[Path]) -> str:
    """One results file from several runs of this benchmark (e.g. one process per point): their rows unchanged, each
    tagged with the file it came from, every run's environment and command kept under ``runs``; the markdown table
    and the figure of the whole. Ratios stay those of each row's own run."""
    payloads = [json.loads(run.read_text()) for run in runs]
    rows = [row | {"run": run.stem} for run, payload in zip(runs, payloads, strict=True) for row in payload["rows"]]
    header = ("Rows of several runs of `eval.bench_floor`, each ratio against the dense row of its own run (its "
              "`run` column). Runs:\n\n" + "\n".join(
                  f"- `{run.stem}`: {payload['env'].get('gpu')}, torch {payload['env'].get('torch')}, source "
                  f"{payload['env'].get('source_sha256')}; `{payload['env'].get('command')}`"
                  for run, payload in zip(runs, payloads, strict=True)))
    table = f"{header}\n\n" + markdown_table(rows, [c for c in ["run", *COLUMNS] if any(c in r for r in rows)])
    command = f"python -m eval.bench_floor --combine {out} " + " ".join(str(run) for run in runs)
    # The environment of the first run (each run's own is under ``runs``), its command this one.
    payload = {"bench": "eval.bench_floor", "env": payloads[0]["env"] | {"command": command}, "command": command,
               "runs": [{"file": run.name, "env": p["env"], "hbm_bytes_per_s": p.get("hbm_bytes_per_s"),
                         "h2d_bytes_per_s": p.get("h2d_bytes_per_s"), "provenance": p.get("provenance")}
                        for run, p in zip(runs, payloads, strict=True)],
               "rows": rows}
    write_results(out, payload, table)
    plot_floor(payload, out)
    return table


def main() -> None:
    code_identity()
    if len(sys.argv) > 1 and sys.argv[1] == "--combine":  # python -m eval.bench_floor --combine OUT RUN.json ...
        if len(sys.argv) < 4:
            raise SystemExit("usage: python -m eval.bench_floor --combine OUT RUN.json [RUN.json ...]")
        print(combine(Path(sys.argv[2]), [Path(a) for a in sys.argv[3:]]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--compare":  # python -m eval.bench_floor --compare BEFORE AFTER OUT.md
        before, after, out = (Path(a) for a in sys.argv[2:5])
        table = compare_profiles(json.loads(before.read_text()), json.loads(after.read_text()))
        out.write_text(f"Kernel families per layer-step before ({before.name}) and after ({after.name}); cells: GPU us "
                       f"per layer-step (kernels per layer-step), torch.profiler over replays of the whole-step graph. "
                       f"`python -m eval.bench_floor --compare {before} {after} {out}`\n\n{table}\n")
        print(table)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--points", nargs="+", default=["8x32512", "1x130560", "16x32512"],
                        help="BATCHxCONTEXT points, each run with all its rows in this process")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--dense-kernels", nargs="+", choices=["sdpa", "triton"], default=["sdpa", "triton"])
    parser.add_argument("--compile-points", nargs="*", default=["8x32512"],
                        help="points that also run dense-compile (it compiles for a minute or more)")
    parser.add_argument("--compile-model", choices=["off", "also", "only"], default="also",
                        help="run the dense-graphed (sdpa) and OasisKV rows with the model through torch.compile "
                             "inside the captured graph (Inductor fuses norms, RoPE, activations): off, also (both "
                             "variants of each row), only (the dense Triton-kernel row runs uncompiled only)")
    parser.add_argument("--compile-modes", nargs="+", choices=["default", "max-autotune-no-cudagraphs"],
                        default=["default"], help="torch.compile modes of the compiled variants, one variant each "
                        "(OasisConfig.compile_mode; the dense row compiles in the same mode)")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--fetch-programs", nargs="+", default=None,
                        help="OasisConfig.fetch_programs of the fetching OasisKV rows (numbers, or 'none' for no cap): "
                             "one row per value, in the same process, labelled with it when there are several; "
                             "default: the library's")
    parser.add_argument("--sync-fetch-blocks", nargs="+", type=int, default=[],
                        help="also run the lookahead rows with each of these OasisConfig.sync_fetch_blocks (the "
                             "in-step correction of the background selection), one row each")
    parser.add_argument("--config", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="OasisConfig fields of every OasisKV row, e.g. the accuracy suite's selection setting: "
                             "block_size=16 sink_tokens=16 recent_tokens=64 summary=mean+minmax")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME FIELD=VALUE",
                        help="also run every OasisKV row with these OasisConfig fields on top of --config, in the "
                             "same process, labelled [NAME: ...] (repeatable), e.g. --variant suite block_size=16 "
                             "sink_tokens=16 recent_tokens=64 summary=mean+minmax")
    parser.add_argument("--delta-rate", type=Path, default=None,
                        help="eval.delta_rate JSON: the highest of its plain-decoding rows' blocks per (seq, head, "
                             "forward), rounded up, becomes the cap of the oasis-lookahead-real row")
    parser.add_argument("--delta-task", default=None,
                        help="use only this task's rows of the --delta-rate JSON (e.g. recall_list)")
    parser.add_argument("--check-context", type=int, default=4096,
                        help="context of the dense-graphed logit check against eager dense attention")
    parser.add_argument("--host-gib", type=float, default=100.0, help="pinned host memory OasisKV may use")
    parser.add_argument("--profile", action="store_true", help="kernel-family tables for the static and lookahead rows")
    parser.add_argument("--profile-points", nargs="*", default=["8x32512", "1x130560"])
    parser.add_argument(PROFILE_CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)  # profiles_from_child
    parser.add_argument("--isolate", action="store_true",
                        help="run every method of every point in a process of its own (the same arguments), so that "
                             "no row is timed after another in its process; the floor and ratios are this process's")
    parser.add_argument(ISOLATED_FLAG, action="store_true", help=argparse.SUPPRESS)  # isolated_point's children
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu: a smoke run of the plumbing (tiny shape; nothing captured, nothing to measure)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    selectors = [selector_of(m) for m in args.methods if m.startswith("oasis-")]
    args.config = config_fields(parser, args.config, [args.budget], rows=[(s, {}) for s in selectors],
                                reserved=RESERVED)
    args.variants = {"": {}}
    for name, *pairs in args.variant:
        if name in args.variants or "=" in name or not pairs:
            parser.error(f"--variant {name!r}: write a new NAME, then FIELD=VALUE pairs")
        jobs_only = any(pair.startswith("selection_interval=") for pair in pairs)  # no static rows (see run_point)
        args.variants[name] = config_fields(parser, pairs, [args.budget], base=args.config,
                                            rows=[(s, {}) for s in selectors if not (jobs_only and s == "static")],
                                            reserved=tuple(f for f in RESERVED if f != "max_fetch_blocks"))
        interval = int(args.variants[name].get("selection_interval", 1))
        if args.repeats % interval:
            parser.error(f"--variant {name}: selection_interval={interval} needs --repeats a multiple of it (the "
                         "timed steps are whole job cycles)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    oasis_hf.register()
    on_gpu = args.device.startswith("cuda")
    # Timings never follow a profiler session in their process: with --profile on the GPU this process times and a
    # child process (the same arguments) profiles.
    profile_child = args.profile and on_gpu and not args.profile_in_process
    args.profile_here = args.profile and not profile_child
    if args.profile_in_process:  # the profiling child: only the points it profiles
        args.points = [point for point in args.points if point in args.profile_points]
    if not on_gpu:
        args.shape = "tiny"  # a smoke run of the plumbing (an 8B shape in float32 would not fit a CPU box)
    shape = SHAPES[args.shape]
    isolate = args.isolate and not args.isolated_child
    # An --isolate parent only counts the model's bytes for the floor: its parameters stay on the meta device.
    model = build_model(shape, "meta" if isolate else args.device, torch.bfloat16 if on_gpu else torch.float32)
    bandwidth = hbm_bandwidth(args.device, 4 * GIB if on_gpu else 2**26)
    h2d = h2d_bandwidth(args.device, GIB if on_gpu else 2**26)
    logger.info("device-to-device copy bandwidth %.2f TB/s, host-to-device %.1f GB/s", bandwidth / 1e12, h2d / 1e9)
    rate, rate_note, args.rate_block_size = delta_rate(args.delta_rate, args.delta_task)
    pool = PinnedPool()
    rows: list[dict] = []
    for text in args.points:
        batch, context = parse_point(text)
        need = batch * (context + 64) * kv_bytes_per_token(model)
        if need > args.host_gib * GIB:
            logger.warning("%s: OasisKV's host store needs %.0f GiB > --host-gib", text, need / GIB)
        if isolate:
            rows.extend(isolated_point(model, args, batch, context, bandwidth))
        else:
            rows.extend(run_point(model, args, batch, context, bandwidth, h2d, pool, rate, rate_note))
        print(report(args, shape, bandwidth, h2d, rows), flush=True)
        pool.clear()
    if profile_child and not isolate:  # an --isolate run's children profile for themselves
        del model  # the child loads its own
        release_memory()
        with tempfile.TemporaryDirectory() as tmp:
            merged = merge_profiles(rows, profiles_from_child("eval.bench_floor", sys.argv[1:], Path(tmp)))
        logger.info("profiles of %d rows taken in a separate process", merged)
    print(report(args, shape, bandwidth, h2d, rows, final=True))


if __name__ == "__main__":
    main()
