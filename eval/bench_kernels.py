"""Kernel roofline check: achieved HBM bandwidth of the sparse attention kernel against a measured device copy, and
the zero-copy delta gather from pinned host memory, alone and beside a decode-like workload.

    python -m eval.bench_kernels --out eval/results/kernels_h200

The decode-step attention reads every resident block once (K and V of ``budget`` tokens per sequence and KV head):
its useful bytes are ``2 * B * H_kv * budget * D * elem``. The kernel is checked against its PyTorch twin first, then
timed inside a CUDA graph (as the decode step runs it) with CUDA events; the reference bandwidth is an eager
device-to-device copy of 4 GiB (milliseconds long, so launch cost does not count) measured in the same run.

The gather table moves what a lookahead job moves at batch 8 (Llama-8B KV shape, block 32, `max_fetch_blocks` 16):
1024 random blocks of K and V (16 MiB) from one layer's pinned host store of 32k tokens into the block pool, for each
program cap (`OasisConfig.fetch_programs`), with the fetch kernel `gather_blocks` (one launch, K and V together) and
the previous path (`copy_rows` twice, offsets precomputed), and as the reference the same bytes in one contiguous
pinned-to-device copy on a copy engine (every row's "% of copy engine"). "alone" is the gather by itself; "beside
compute" replays it on a second stream while the compute stream runs a decode-like graph (the 8B MLP GEMMs at batch 8
and the sparse attention), and reports the gather's bandwidth there and how much it slowed the compute. The
projection table times one Llama-8B layer's weight GEMMs as transformers issues them and with q/k/v and gate/up
fused. The job interference table runs each part of a lookahead selection job (scoring, plan, gather, and the whole
job) beside those GEMMs, forked per layer onto a highest-priority stream as the whole-step graph forks it, and
reports how much each part slows them; then a job that moves a delta at every replay beside a whole 32-layer step
with its lm_head, forked after every layer and with the jobs of 2, 4 or 8 layers forked together.
``--gemm-sm-carveouts`` repeats that table with the GEMMs on cuBLASLt told to leave some SMs free (PyTorch's
experimental SM carve-out, which only cuBLASLt honours), the question being whether GEMMs sized for fewer SMs stop
paying for the job beside them. Prints markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from eval._common import code_identity, environment, finish, markdown_table, median
from eval.plot import plot_kernels
from oasis_hf.cache.block_table import BlockTable
from oasis_hf.cache.prefetch import background_stream
from oasis_hf.config import OasisConfig
from oasis_hf.kernels import (
    block_mass,
    block_mass_ref,
    copy_rows,
    gather_blocks,
    score_blocks,
    score_blocks_ref,
    sparse_attention,
    sparse_attention_ref,
)
from oasis_hf.kernels.plan_blocks import supported as plan_kernel_supported
from oasis_hf.kernels.ref import CODES_PER_BYTE

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


#: The gather table's reference row: the same bytes in one contiguous copy on a copy engine.
COPY_ENGINE = "copy engine (one contiguous copy)"


def gather_rows(programs_list: list[int | None], batch: int = 8, heads: int = 8, per_head: int = 16,
                context: int = 32768, block: int = 32, head_dim: int = 128) -> list[dict]:
    """The delta gather for each program cap, alone and beside a decode-like compute graph (see module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    num_blocks, row = context // block, block * head_dim
    store_shape = (batch, heads, num_blocks, block, head_dim)
    host_k = torch.randn(store_shape, dtype=torch.bfloat16).pin_memory()
    host_v = torch.randn(store_shape, dtype=torch.bfloat16).pin_memory()
    pool_shape = (batch, heads, 64, block, head_dim)
    pool_k = torch.zeros(pool_shape, dtype=torch.bfloat16, device="cuda")
    pool_v = torch.zeros_like(pool_k)
    bh = torch.arange(batch * heads, device="cuda").view(batch, heads, 1)
    blocks = torch.randint(0, num_blocks, (batch, heads, per_head), device="cuda", generator=gen)
    slots = torch.rand(batch, heads, 64, device="cuda", generator=gen).argsort(-1)[..., :per_head]
    src_off = ((bh * num_blocks + blocks) * row).reshape(-1)
    dst_off = ((bh * 64 + slots) * row).reshape(-1)
    nbytes = 2 * src_off.numel() * row * 2
    # Decode-like compute: the MLP of one Llama-8B layer at batch 8 (memory-bound GEMMs) + the layer's attention.
    x = torch.randn(batch, 4096, dtype=torch.bfloat16, device="cuda", generator=gen)
    w_up = torch.randn(4096, 2 * 14336, dtype=torch.bfloat16, device="cuda", generator=gen)
    w_down = torch.randn(14336, 4096, dtype=torch.bfloat16, device="cuda", generator=gen)
    q = torch.randn(batch, 32, 1, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    slot_block = torch.rand(batch, heads, num_blocks, device="cuda", generator=gen).argsort(-1)[..., :64]
    kv_start = torch.zeros(batch, dtype=torch.long, device="cuda")
    seq = torch.tensor(context, device="cuda")

    def compute():
        for _ in range(8):
            h = x @ w_up
            (h[:, :14336] * h[:, 14336:]) @ w_down
            sparse_attention(q, pool_k, pool_v, slot_block, seq, kv_start, head_dim**-0.5)

    def capture(fn) -> torch.cuda.CUDAGraph:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    def timed(graph, stream, times: int = 1):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            begin.record()
            for _ in range(times):
                graph.replay()
            end.record()
        return begin, end

    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    compute_graph = capture(compute)
    compute_alone = median([_elapsed(*timed(compute_graph, main)) for _ in range(20)])
    valid = torch.ones_like(blocks, dtype=torch.bool)
    # The reference: the same bytes as one contiguous pinned-to-device copy on a copy engine (no SM involved), the
    # most the host link gives; the gather's scattered blocks cannot go that way in one call.
    engine_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    engine_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = []
    variants = [(p, k) for p in programs_list for k in ("gather_blocks", "copy_rows x2")]
    for programs, kernel in [*variants, (None, COPY_ENGINE)]:
        def gather(programs=programs, kernel=kernel):
            if kernel == "gather_blocks":  # the fetch path: one launch, offsets from the plan, K and V together
                gather_blocks(host_k, host_v, pool_k, pool_v, blocks, slots, valid, 0, programs)
            elif kernel == COPY_ENGINE:
                engine_dst.copy_(engine_src, non_blocking=True)
            else:  # the previous fetch path: offsets precomputed, one launch for K and one for V
                copy_rows(host_k, src_off, pool_k, dst_off, row, programs)
                copy_rows(host_v, src_off, pool_v, dst_off, row, programs)

        pool_k.zero_()
        # A pinned host-to-device copy is issued as is (one cudaMemcpyAsync; not captured: the caching host
        # allocator records an event per copy, which a capture may refuse).
        gather_graph = SimpleNamespace(replay=gather) if kernel == COPY_ENGINE else capture(gather)
        alone = median([_elapsed(*timed(gather_graph, main)) for _ in range(20)])
        repeat = max(1, round(compute_alone / alone))
        beside, slowed = [], []
        for _ in range(20):
            torch.cuda.synchronize()
            go = torch.cuda.Event()
            go.record(main)
            side.wait_event(go)
            g = timed(gather_graph, side, repeat)
            c = timed(compute_graph, main)
            torch.cuda.synchronize()
            beside.append(_elapsed(*g) / repeat)
            slowed.append(_elapsed(*c))
        cap = "-" if kernel == COPY_ENGINE else "all" if programs is None else programs
        rows.append({"programs": cap, "kernel": kernel, "MB moved": nbytes / 1e6,
                     "alone us": alone * 1e3, "alone GB/s": nbytes / (alone / 1e3) / 1e9,
                     "beside compute GB/s": nbytes / (median(beside) / 1e3) / 1e9,
                     "compute us alone": compute_alone * 1e3, "compute us beside gather": median(slowed) * 1e3,
                     "compute slowdown": median(slowed) / compute_alone})
        if kernel == COPY_ENGINE:
            assert torch.equal(engine_dst.cpu(), engine_src)
            continue
        # correctness of what was timed (the last replay wrote the same rows)
        moved = pool_k.view(-1, row)[dst_off // row].cpu()
        torch.testing.assert_close(moved, host_k.view(-1, row)[src_off.cpu() // row])
    engine = rows[-1]["alone GB/s"]
    for entry in rows:
        entry["% of copy engine (alone)"] = 100 * entry["alone GB/s"] / engine
    return rows


def plan_rows(shapes: list[tuple[int, int, int, int]]) -> list[dict]:
    """The selection plan of one layer-step (`BlockTable.plan`), the one-launch Triton kernel against the PyTorch
    twin (~57 small kernels), both replayed in a CUDA graph as the step and the selection job run them. Each shape is
    (B, H_kv, NB, S); the plan is checked equal first."""
    rows = []
    for batch, heads, num_blocks, num_slots in shapes:
        if not plan_kernel_supported(num_blocks, num_slots):  # BlockTable.plan would time the twin twice
            logger.warning("plan %s: beyond the kernel's size limit, skipped", (batch, heads, num_blocks, num_slots))
            continue
        gen = torch.Generator(device="cuda").manual_seed(num_blocks)
        scores = torch.rand(batch, heads, num_blocks, device="cuda", generator=gen)
        scores[..., :2] = float("inf")  # sinks and the recent window
        scores[..., -4:] = float("inf")
        tables = {b: BlockTable(batch, heads, num_slots, num_blocks, "cuda") for b in ("triton", "torch")}
        plans = {b: t.plan(scores, 16, "auto" if b == "triton" else "torch") for b, t in tables.items()}
        same = all(torch.equal(x, y) for x, y in zip(plans["triton"], plans["torch"], strict=True))
        row = {"B": batch, "H_kv": heads, "NB": num_blocks, "S": num_slots, "plans equal": same}
        for backend, table in tables.items():
            fresh = torch.rand(batch, heads, num_blocks, device="cuda", generator=gen)  # a new selection each step
            scores.copy_(torch.where(scores == float("inf"), scores, fresh))
            label = "kernel us" if backend == "triton" else "twin us"
            kind = "auto" if backend == "triton" else "torch"
            row[label] = 1e3 * time_cuda(lambda t=table, s=scores, k=kind: t.plan(s, 16, k))
        row["speed-up"] = row["twin us"] / row["kernel us"]
        rows.append(row)
        logger.info("plan %s", row)
    return rows


def mass_rows(shapes: list[tuple[int, int, int, int, int]]) -> list[dict]:
    """The prefill window's exact attention mass per block (`block_mass`: two launches) against its PyTorch twin
    (a float32 GEMM, mask, softmax and sums over (B, H_kv, G * W, N) float32 tensors), bf16, D 128, blocks of 32,
    both replayed in a CUDA graph; checked against the twin first. Each shape is (B, H_q, H_kv, W, N): the last W
    queries against N keys."""
    rows = []
    for batch, q_heads, kv_heads, window, num_keys in shapes:
        gen = torch.Generator(device="cuda").manual_seed(num_keys)
        query = torch.randn(batch, q_heads, window, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        keys = torch.randn(batch, kv_heads, num_keys, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        q_pos = torch.arange(num_keys - window, num_keys, device="cuda")
        kv_start = torch.zeros(batch, dtype=torch.long, device="cuda")
        capacity = -(-num_keys // 32)
        args = (query, keys, 128**-0.5, q_pos, kv_start, 32, capacity)
        err = (block_mass(*args) - block_mass_ref(*args)).abs().max().item()
        row = {"B": batch, "H_q": q_heads, "H_kv": kv_heads, "W": window, "N": num_keys,
               "kernel us": 1e3 * time_cuda(lambda a=args: block_mass(*a), per_graph=5),
               "twin us": 1e3 * time_cuda(lambda a=args: block_mass_ref(*a), per_graph=5),
               "max abs err vs twin": err}
        row["speed-up"] = row["twin us"] / row["kernel us"]
        rows.append(row)
        logger.info("mass %s", row)
    return rows


def score_rows(shapes: list[tuple[int, int, int, int]], kinds: tuple[str, ...] = ("mean",),
               reranks: tuple[int, ...] = (0,)) -> list[dict]:
    """Block scoring of one layer-step (`score_blocks`, the selection memory on) per summary kind in `kinds` (mean
    keys; ``quantized``: bounds, mean key and 2-bit codes of every key, scored per token, once per k of `reranks`:
    0 reads every block's codes, k > 0 those of ``k * S`` candidates, `OasisConfig.score_candidates` at budget 2048),
    Llama-8B heads (32 query heads over 8 KV heads, D 128, bf16), replayed in a CUDA graph; checked against the twin
    first. Each shape is (B, H_kv, NB, T): NB blocks of 32 scored by T query rows per head."""
    rows = []
    runs = [(kind, rerank) for kind in kinds for rerank in (reranks if kind == "quantized" else (0,))]
    for kind, rerank in runs:
        for batch, heads, num_blocks, tokens in shapes:
            gen = torch.Generator(device="cuda").manual_seed(num_blocks + tokens)
            query = torch.randn(batch, 4 * heads, tokens, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
            vectors = torch.randn(2, batch, heads, num_blocks, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
            summaries, codes, candidates = vectors[:1].contiguous(), None, 0
            if kind == "quantized":  # bounds lo <= hi, a mean between them, random codes
                summaries = torch.stack([vectors.amin(0), vectors.amax(0), vectors.mean(0)])
                codes = torch.randint(0, 256, (batch, heads, num_blocks, 32, 128 // CODES_PER_BYTE), device="cuda",
                                      dtype=torch.uint8, generator=gen)
                candidates = OasisConfig(summary="quantized", quantized_rerank=rerank, sink_tokens=32,
                                         recent_tokens=96).score_candidates(0, tokens)  # the rules' 1 + 4 blocks
            memory = torch.rand(batch, heads, num_blocks, device="cuda", generator=gen)
            kv_start = torch.zeros(batch, dtype=torch.long, device="cuda")
            start = torch.tensor(num_blocks * 32 - 16 - tokens, device="cuda")
            rules = dict(kind=kind, source="summaries", num_tokens=tokens, block_size=32, sink_blocks=1,
                         recent_blocks=4, decay=0.9, codes=codes, candidates=candidates)
            out = score_blocks(query, summaries, None, memory.clone(), kv_start, start, 128**-0.5, **rules)
            ref = score_blocks_ref(query, summaries, None, memory.clone(), kv_start, start, 128**-0.5, **rules)
            finite = torch.isfinite(ref)
            err = (out[finite] - ref[finite]).abs().max().item() / ref[finite].abs().max().item()
            same_rules = torch.equal(torch.isfinite(out), finite) and torch.equal(out[~finite], ref[~finite])
            ms = time_cuda(lambda q=query, s=summaries, m=memory, k=kv_start, st=start, r=rules: score_blocks(
                q, s, None, m, k, st, 128**-0.5, **r))
            read_codes = 0 if codes is None else codes[:, :, :candidates or num_blocks].numel()
            nbytes = (summaries.numel() * summaries.element_size() + read_codes
                      + 3 * memory.numel() * 4)  # memory read, written; out
            code_blocks = candidates or (num_blocks if codes is not None else 0)
            rows.append({"summary": kind, "blocks read by codes": code_blocks, "B": batch, "H_kv": heads,
                         "NB": num_blocks, "T": tokens, "us": ms * 1e3, "MB moved": nbytes / 1e6,
                         "GB/s": nbytes / (ms / 1e3) / 1e9, "rules equal": same_rules, "max rel err vs twin": err})
            logger.info("score %s", rows[-1])
    return rows


#: Llama-3.1-8B's per-layer projections (out, in features): what every decode step reads, dense or OasisKV.
PROJECTIONS = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096),
               "up": (14336, 4096), "down": (4096, 14336)}


def projection_rows(batches: list[int]) -> list[dict]:
    """One Llama-8B layer's weight GEMMs at `batch` rows (cuBLAS through ``F.linear``), as transformers' Llama issues
    them (seven GEMMs: q, k, v, o, gate, up, down) and with the projections that read the same input fused (q/k/v in
    one GEMM, gate/up in one): the same weight bytes in five launches. The GEMMs are two thirds of an OasisKV decode
    step and most of a dense one, so this is the lever both share."""
    F = torch.nn.functional
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {name: torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen) * 0.02
               for name, shape in PROJECTIONS.items()}
    qkv = torch.cat([weights["q"], weights["k"], weights["v"]])
    gate_up = torch.cat([weights["gate"], weights["up"]])
    qkv_split = [PROJECTIONS[name][0] for name in ("q", "k", "v")]
    inner = PROJECTIONS["gate"][0]
    nbytes = sum(w.numel() * w.element_size() for w in weights.values())

    def separate(x):  # (out, k, v): the layer's output and the K/V projections a cache would store
        q, k, v = F.linear(x, weights["q"]), F.linear(x, weights["k"]), F.linear(x, weights["v"])
        h = F.linear(q, weights["o"])
        return F.linear(F.linear(h, weights["gate"]) * F.linear(h, weights["up"]), weights["down"]), k, v

    def fused(x):
        q, k, v = F.linear(x, qkv).split(qkv_split, dim=-1)
        gate, up = F.linear(F.linear(q, weights["o"]), gate_up).split([inner, inner], dim=-1)
        return F.linear(gate * up, weights["down"]), k, v

    rows = []
    for batch in batches:
        x = torch.randn(batch, PROJECTIONS["q"][1], dtype=torch.bfloat16, device="cuda", generator=gen)
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(separate(x), fused(x), strict=True))
        for name, fn in (("separate (7 GEMMs)", separate), ("q/k/v and gate/up fused (5 GEMMs)", fused)):
            ms = time_cuda(lambda fn=fn, x=x: fn(x), per_graph=32)
            rows.append({"batch": batch, "projections": name, "us per layer": ms * 1e3, "MB of weights": nbytes / 1e6,
                         "GB/s": nbytes / (ms / 1e3) / 1e9, "max abs diff fused vs separate": err})
    return rows


#: The pieces of a lookahead selection job `job_interference_rows` runs beside the GEMMs, alone and together.
JOB_PARTS = ("score", "plan", "gather", "score + plan", "job (score + plan + gather)")


def job_interference_rows(batch: int = 8, heads: int = 8, context: int = 32768, block: int = 32, budget: int = 2048,
                          fetch_blocks: int = 5, programs: int = 16, layers: int = 8) -> list[dict]:
    """What each kernel of a lookahead selection job costs the weight GEMMs it runs beside.

    One CUDA graph holds `layers` Llama-8B layers' weight GEMMs (`projection_rows`' separate path) at `batch` rows on
    the compute stream; with a part of the job, each layer also forks that part onto a highest-priority side stream
    (as `DecodeGraph` forks a layer's job; the library's `background_stream`) and the graph joins it at the end. The
    job is the 8B shape's at `context` tokens: `score_blocks` over mean-key summaries (one query token, the selection
    memory on), `BlockTable.plan` of a `budget`-token table with a cap of `fetch_blocks` (the real model's rate) on
    fresh random scores, and `gather_blocks` of `fetch_blocks` blocks per (sequence, head) from pinned host memory
    with `programs` programs. Reported per layer-step: the graph's time, its excess over the GEMMs alone, and the
    part's own time alone (its kernels in a graph by themselves)."""
    F = torch.nn.functional
    gen = torch.Generator(device="cuda").manual_seed(3)
    weights = {name: torch.randn(shape, dtype=torch.bfloat16, device="cuda", generator=gen) * 0.02
               for name, shape in PROJECTIONS.items()}
    x = torch.randn(batch, PROJECTIONS["q"][1], dtype=torch.bfloat16, device="cuda", generator=gen)
    num_blocks, slots, head_dim = context // block, budget // block, 128
    query = torch.randn(batch, 4 * heads, 1, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    summaries = torch.randn(1, batch, heads, num_blocks, head_dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    memory = torch.rand(batch, heads, num_blocks, device="cuda", generator=gen)
    kv_start = torch.zeros(batch, dtype=torch.long, device="cuda")
    start = torch.tensor(context - 1, device="cuda")
    rules = dict(kind="mean", source="summaries", num_tokens=1, block_size=block, sink_blocks=1, recent_blocks=4,
                 decay=0.9)
    table = BlockTable(batch, heads, slots, num_blocks, "cuda")
    fresh = torch.rand(batch, heads, num_blocks, device="cuda", generator=gen)
    table.plan(fresh, None, "auto")  # a full table: later plans evict and fetch
    store = (batch, heads, num_blocks, block, head_dim)
    host_k = torch.randn(store, dtype=torch.bfloat16).pin_memory()
    host_v = torch.randn(store, dtype=torch.bfloat16).pin_memory()
    pool_k = torch.zeros(batch, heads, slots, block, head_dim, dtype=torch.bfloat16, device="cuda")
    pool_v = torch.zeros_like(pool_k)
    fetch = torch.randint(0, num_blocks, (batch, heads, fetch_blocks), device="cuda", generator=gen)
    into = torch.rand(batch, heads, slots, device="cuda", generator=gen).argsort(-1)[..., :fetch_blocks].contiguous()
    every = torch.ones_like(fetch, dtype=torch.bool)

    def gemms():  # one layer's seven weight GEMMs (k and v computed for the cache, unused here)
        q, _, _ = F.linear(x, weights["q"]), F.linear(x, weights["k"]), F.linear(x, weights["v"])
        h = F.linear(q, weights["o"])
        F.linear(F.linear(h, weights["gate"]) * F.linear(h, weights["up"]), weights["down"])

    def score():
        return score_blocks(query, summaries, None, memory, kv_start, start, head_dim**-0.5, **rules)

    def plan(scores=None):
        if scores is None:
            scores = torch.rand(batch, heads, num_blocks, device="cuda", out=fresh)  # a new selection every step
        return table.plan(scores, fetch_blocks, "auto")

    def gather(delta=None):
        blocks, into_, valid = delta if delta is not None else (fetch, into, every)
        gather_blocks(host_k, host_v, pool_k, pool_v, blocks, into_, valid, 0, programs)

    parts = {"score": score, "plan": plan, "gather": gather, "score + plan": lambda: plan(score()),
             "job (score + plan + gather)": lambda: gather(plan(score()))}
    side = background_stream(torch.device("cuda"))

    def step(part=None, group=1, depth=layers, head=False):
        """`depth` layers' GEMMs, each layer forking `part` (or, with `group` > 1, the parts of `group` layers forked
        together after the last of them); with `head`, the lm_head GEMM after the last layer, as a model's step
        ends (the last jobs run beside it)."""
        main = torch.cuda.current_stream()
        for layer in range(depth):
            if part is not None and (layer + 1) % group == 0:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    for _ in range(group):
                        part()
            gemms()
        if head:
            F.linear(x, lm_head)
        if part is not None:
            main.wait_stream(side)

    def per_layer_us(fn) -> float:  # `fn` captured in a graph of its own and replayed (`time_cuda`)
        return 1e3 * time_cuda(fn, per_graph=1) / layers

    alone = per_layer_us(step)
    rows = [{"beside the GEMMs": "nothing", "us per layer-step": alone, "excess us": 0.0}]
    for name in JOB_PARTS:
        part = parts[name]
        with_part = per_layer_us(lambda part=part: step(part))
        own = per_layer_us(lambda part=part: [part() for _ in range(layers)])
        rows.append({"beside the GEMMs": name, "us per layer-step": with_part, "excess us": with_part - alone,
                     "part alone us": own})
        logger.info("job interference %s", rows[-1])
    # A job that moves a delta at every replay: scoring, a plan on fresh scores, the gather of a fixed delta. Forked
    # per layer, and with the jobs of `group` consecutive layers forked together after the last of them (one fork
    # per group: the question is whether the GEMMs pay per concurrent period or per kernel).
    def job():
        score()
        plan()
        gather()

    # A whole step: 32 layers and the lm_head (Llama-8B's), so the last group's jobs have the head to run beside.
    depth = 32
    lm_head = torch.randn(128256, PROJECTIONS["q"][1], dtype=torch.bfloat16, device="cuda", generator=gen) * 0.02
    own = per_layer_us(lambda: [job() for _ in range(layers)])
    whole = 1e3 * time_cuda(lambda: step(depth=depth, head=True), per_graph=1) / depth
    rows.append({"beside the GEMMs": f"nothing ({depth} layers and the lm_head)", "us per layer-step": whole,
                 "excess us": 0.0})
    for group in (1, 2, 4, 8):
        with_part = 1e3 * time_cuda(lambda group=group: step(job, group, depth, head=True), per_graph=1) / depth
        rows.append({"beside the GEMMs": f"score + plan + gather of 5 blocks, {depth} layers and the lm_head, forked "
                                         f"every {group} layer(s)",
                     "us per layer-step": with_part, "excess us": with_part - whole, "part alone us": own})
        logger.info("job interference %s", rows[-1])
    return rows


@contextlib.contextmanager
def gemm_library(carveout: int | None):
    """The weight GEMMs on cuBLAS as PyTorch picks it (`carveout` None), or on cuBLASLt sized for all SMs but
    `carveout` (``torch._C._set_sm_carveout_experimental``, honoured by cuBLASLt only); both process-wide settings
    are restored on exit. A CUDA graph keeps the kernels chosen while it was captured."""
    if carveout is None:
        yield "cuBLAS"
        return
    library = torch.backends.cuda.preferred_blas_library()
    previous = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(carveout)
    try:
        yield f"cuBLASLt, {carveout} SMs left out"
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        torch.backends.cuda.preferred_blas_library(library)


def _elapsed(begin, end) -> float:
    end.synchronize()
    return begin.elapsed_time(end)


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="query tokens per step (1 + drafts)")
    parser.add_argument("--gather-programs", type=int, nargs="*", default=[0, 128, 64, 32, 16, 8, 4],
                        help="program caps of the gather table (0 = no cap); none: skip the table")
    parser.add_argument("--plan", type=str, nargs="*",
                        default=["8,8,1025,64", "16,8,1025,64", "32,8,1025,64", "1,8,2048,64", "1,8,4097,64"],
                        help="shapes B,H_kv,NB,S of the plan table (none: skip it)")
    parser.add_argument("--score", type=str, nargs="*",
                        default=["8,8,1025,1", "16,8,1025,1", "1,8,4097,1", "8,8,1025,5"],
                        help="shapes B,H_kv,NB,T of the scoring table (none: skip it)")
    parser.add_argument("--mass", type=str, nargs="*", default=["8,12,2,32,16000", "1,12,2,32,16000",
                                                                  "8,32,8,32,32512"],
                        help="shapes B,H_q,H_kv,W,N of the prefill-window mass table (none: skip it)")
    parser.add_argument("--score-summaries", nargs="+", default=["mean"], choices=["mean", "quantized"],
                        help="summary kinds of the scoring table (quantized: its bytes and time beside mean keys)")
    parser.add_argument("--score-rerank", nargs="+", type=int, default=[0],
                        help="quantized rows: k of the two-stage scoring (OasisConfig.quantized_rerank), one row "
                             "each; 0 reads every block's codes")
    parser.add_argument("--projections", type=int, nargs="*", default=[1, 8, 16],
                        help="batches of the weight-GEMM table (one Llama-8B layer; none: skip it)")
    parser.add_argument("--job-interference", type=int, nargs="*", default=[8],
                        help="batches of the job-interference table (each part of a lookahead job beside a layer's "
                             "GEMMs; none: skip it)")
    parser.add_argument("--gemm-sm-carveouts", type=int, nargs="*", default=[],
                        help="after the cuBLAS job-interference table, run it again per value with the GEMMs on "
                             "cuBLASLt leaving that many SMs free (0: cuBLASLt on every SM)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if any(n < 0 for n in args.gemm_sm_carveouts):
        parser.error(f"--gemm-sm-carveouts {args.gemm_sm_carveouts}: give numbers of SMs >= 0")
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
    table = header + markdown_table(rows, columns)
    gathers = gather_rows([p or None for p in args.gather_programs]) if args.gather_programs else []
    if gathers:
        table += ("\n\nDelta gather from pinned host memory, 1024 blocks of K and V (batch 8 x 8 KV heads x 16), "
                  "block 32 x 128 bf16, by program cap (`OasisConfig.fetch_programs`); compute = 8 x (Llama-8B MLP at "
                  "batch 8 + sparse attention at budget 2048), on another stream:\n\n")
        table += markdown_table(gathers, ["programs", "kernel", "MB moved", "alone us", "alone GB/s",
                                          "% of copy engine (alone)", "beside compute GB/s", "compute us alone",
                                          "compute us beside gather", "compute slowdown"])
    plans = plan_rows([tuple(int(x) for x in shape.split(",")) for shape in args.plan])
    if plans:
        table += ("\n\nSelection plan of one layer-step (`BlockTable.plan`: top-S, hit/miss, eviction order, capped "
                  "delta of 16, table update), each replayed in a CUDA graph; NB 1025 / 4097 = 32k / 128k tokens in "
                  "blocks of 32, S 64 = budget 2048:\n\n")
        table += markdown_table(plans, ["B", "H_kv", "NB", "S", "plans equal", "kernel us", "twin us", "speed-up"])
    scores = score_rows([tuple(int(x) for x in shape.split(",")) for shape in args.score], tuple(args.score_summaries),
                        tuple(args.score_rerank))
    if scores:
        table += ("\n\nBlock scoring of one layer-step (`score_blocks`: mean keys, softmax over the blocks; quantized, "
                  "softmax over the tokens; selection memory), replayed in a CUDA graph; bytes: the summaries (and "
                  "codes) read once, the memory read and "
                  "written, the scores written:\n\n")
        table += markdown_table(scores, ["summary", "blocks read by codes", "B", "H_kv", "NB", "T", "us",
                                         "MB moved", "GB/s", "rules equal", "max rel err vs twin"])
    masses = mass_rows([tuple(int(x) for x in shape.split(",")) for shape in args.mass])
    if masses:
        table += ("\n\nThe prefill window's first selection (`block_mass`: the exact attention mass per block of the "
                  "last W queries, two launches) against its PyTorch twin, bf16, D 128, blocks of 32, replayed in a "
                  "CUDA graph:\n\n")
        table += markdown_table(masses, ["B", "H_q", "H_kv", "W", "N", "kernel us", "twin us", "speed-up",
                                         "max abs err vs twin"])
    projections = projection_rows(args.projections) if args.projections else []
    if projections:
        table += ("\n\nWeight GEMMs of one Llama-8B layer (cuBLAS, bf16; plus the SwiGLU product), 32 layers per CUDA "
                  "graph, as transformers' Llama issues them and with the projections that share an input fused:\n\n")
        table += markdown_table(projections, ["batch", "projections", "us per layer", "MB of weights", "GB/s",
                                              "max abs diff fused vs separate"])
    interference = []
    for carveout in [None, *args.gemm_sm_carveouts] if args.job_interference else []:
        with gemm_library(carveout) as gemms:
            interference += [row | {"batch": batch, "GEMMs": gemms} for batch in args.job_interference
                             for row in job_interference_rows(batch)]
    if interference:
        table += ("\n\nA lookahead job's parts beside the weight GEMMs (Llama-8B layers, 32k tokens, budget 2048, 5 "
                  "blocks fetched per sequence and KV head, 16 gather programs): each layer forks the part onto a "
                  "highest-priority stream, as the whole-step graph does; microseconds per layer-step:\n\n")
        table += markdown_table(interference, ["batch", "GEMMs", "beside the GEMMs", "us per layer-step", "excess us",
                                               "part alone us"])
    finish(args, table, {"env": env, "copy GB/s": hbm, "rows": rows, "gather": gathers, "plan": plans,
                         "score": scores, "mass": masses, "projections": projections, "job interference": interference},
           plot_kernels)


if __name__ == "__main__":
    main()
