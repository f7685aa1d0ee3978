"""Remote KV tier: decode-node memory, partial-pull throughput on loopback, and how far ahead prefetch must run.

    python -m eval.bench_remote --context 32768 --steps 8 --out eval/results/remote_8b_32k
    python -m eval.bench_remote --model smollm2-135m-instruct --context 2000 --budget 256 --steps 32 \
        --ahead-blocks 0 16 --out eval/results/remote_smollm2_2k

A Llama-3.1-8B-shaped KV cache (32 layers, 8 KV heads, head dim 128, bf16; no model weights are needed: K/V/Q are
random and go through the Cache API and the oasis attention, as in `eval.bench_multigpu`) is prefilled into an
`OasisCache`, published to a Mooncake Store (a master and a pool process started here, on loopback), and attached
on a "decode node" `OasisCache` that then runs `--steps` decode steps with lookahead selection pulling each step's
delta from the pool. Random queries make the selection change as much as the fetch cap allows, so the pulled bytes
per step are a worst case.

Reported:
- decode-node GPU-side KV bytes (pool + summaries + tables; the run is on the CPU, the tensors are the ones a GPU
  would hold) and host bytes (tail ring + hot-block cache) per sequence, against a decode node that holds the full
  KV (dense `DynamicCache` on the GPU; a local `OasisCache`'s host store);
- blocks/s and MB/s of the partial pulls, inside the decode jobs and in a direct batched-get loop;
- the lead (in decode steps) a prefetch needs to hide one step's pulls at network bandwidths from this loopback
  measurement to RDMA-class links: ``ceil(bytes per step / bandwidth / step time)``.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

import oasis_hf
from eval._common import code_identity, environment, finish, markdown_table, median
from eval._harness import LLAMA_8B
from eval.plot import plot_remote_memory
from oasis_hf.remote import MooncakeCluster, MooncakeTier, attach, publish
from oasis_hf.remote.store import block_key

logger = logging.getLogger("eval.bench_remote")


@torch.inference_mode()
def forward_kv(cache: oasis_hf.OasisCache, config: LlamaConfig, batch: int, tokens: int, dtype, gen) -> None:
    """One forward's worth of random K/V (and queries) through every layer of `cache` (Cache API + attention)."""
    head_dim = config.hidden_size // config.num_attention_heads
    for layer in cache.oasis_layers:
        shape = (batch, config.num_key_value_heads, tokens, head_dim)
        keys = torch.randn(shape, generator=gen).to(dtype)
        values = torch.randn(shape, generator=gen).to(dtype)
        handle, values = cache.update(keys, values, layer.layer_idx)
        query = torch.randn(batch, config.num_attention_heads, 1 if tokens > 16 else tokens, head_dim,
                            generator=gen).to(dtype)
        layer.attend(query, handle, values, None, head_dim**-0.5)


@torch.inference_mode()
def real_model(args) -> None:
    """A real model on this CPU: prefill a pass-key prompt, publish, attach once per network-prefetch setting and
    decode greedily; the selection now follows real attention, so pulling ahead can pay off."""
    from oasis_hf import models
    from oasis_hf.cli import passkey_prompt

    model, tokenizer = models.load(args.model, device="cpu")
    oasis_hf.enable(model)
    prompt, key = passkey_prompt(args.context, tokenizer)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    cfg = oasis_hf.OasisConfig(budget_tokens=args.budget, selector="lookahead")

    def decode(cache, first):
        token, out = first.view(-1, 1), []
        for _ in range(args.steps):
            out.append(int(token))
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return out

    local = oasis_hf.OasisCache(model.config, cfg)
    first = model(ids, past_key_values=local, use_cache=True).logits[:, -1].argmax(-1)
    reference = decode(local, first)
    local.close()
    rows = []
    with MooncakeCluster(pool_bytes=1 << 30) as cluster:
        prefill = oasis_hf.OasisCache(model.config, cfg)
        model(ids, past_key_values=prefill, use_cache=True)
        tier = MooncakeTier(cluster.master_address)
        publish(prefill, tier, "real")
        prefill.close()
        for i, ahead in enumerate(args.ahead_blocks):
            cache, _ = attach(model.config, tier, "real", "cpu", ahead_blocks=ahead, hot_blocks=args.hot_blocks,
                              free_on_close=i == len(args.ahead_blocks) - 1)
            store = cache.host
            attach_pulled = store.pulled_blocks
            tokens = decode(cache, first)
            demand = store.pulled_blocks - attach_pulled
            rows.append({"ahead blocks/layer-step": ahead, "hot cache blocks": store.hot_blocks,
                         "host MiB": store.nbytes / 2**20, "pulled on demand/step": demand / args.steps,
                         "pulled ahead/step": store.ahead_pulled / args.steps,
                         "ahead hits/step": store.ahead_hits / args.steps,
                         "share of needed blocks found hot": store.hot_hits / max(1, store.hot_hits + demand),
                         "job waits on ahead pulls s": store.net_wait_seconds,
                         "same tokens as a local OasisCache": tokens == reference})
            cache.close()
        tier.close()
    env = environment()
    header = (f"Test configuration: CPU, torch {env['torch']}, transformers {env['transformers']}; model {args.model} "
              f"(fp32), pass-key prompt of {ids.shape[1]} tokens, budget {args.budget}, lookahead selection, "
              f"{args.steps} greedy steps; Mooncake master + pool on loopback; `{env['command']}`\n\n")
    answer = tokenizer.decode(reference)
    table = header + markdown_table(rows, list(rows[0])) + f"\n\nAnswer: {answer!r} (pass key {key})."
    finish(args, table, {"env": env, "rows": rows, "answer": answer, "key": key})


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="decode steps on the decode node")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[25.0, 40.0],
                        help="decode step times for the lead table (H200, 8B shape: 22.7-25.1 ms with nothing "
                             "moving, 39.8 ms at batch 8 with current-query; eval/results)")
    parser.add_argument("--bandwidths-gbs", type=float, nargs="+", default=[12.5, 25.0, 50.0],
                        help="network GB/s for the lead table besides the measured loopback (100/200/400 Gb/s)")
    parser.add_argument("--ahead-blocks", type=int, nargs="+", default=[0, 4],
                        help="network prefetch settings to compare (blocks per layer-step pulled ahead of need)")
    parser.add_argument("--hot-blocks", type=int, default=None, help="decode-node hot cache (default: attach's)")
    parser.add_argument("--model", default=None,
                        help="a packaged model (oasis-hf models) to run instead of the synthetic 8B-shaped KV")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.model is not None:
        real_model(args)
        return
    dtype = torch.bfloat16
    config = LlamaConfig(**LLAMA_8B)
    gen = torch.Generator().manual_seed(0)
    cfg = oasis_hf.OasisConfig(budget_tokens=args.budget, selector="lookahead", host_capacity_tokens=args.context + 64)
    per_token = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    full_kv = per_token * args.context * config.num_hidden_layers * args.batch
    with MooncakeCluster(pool_bytes=int(full_kv * 1.3) + (256 << 20)) as cluster:
        # Prefill node.
        prefill = oasis_hf.OasisCache(config, cfg)
        t0 = time.perf_counter()
        forward_kv(prefill, config, args.batch, args.context, dtype, gen)
        fill_s = time.perf_counter() - t0
        full_host = prefill.host_nbytes()
        dense_gpu = prefill.dense_nbytes()
        prefill_tier = MooncakeTier(cluster.master_address)
        t0 = time.perf_counter()
        published = publish(prefill, prefill_tier, "bench")
        publish_s = time.perf_counter() - t0
        prefill.close()
        del prefill
        logger.info("published %.0f MiB in %.1f s", published / 2**20, publish_s)

        # Decode node, once per network-prefetch setting (the same published request).
        tier = MooncakeTier(cluster.master_address)
        runs = []
        for i, ahead in enumerate(args.ahead_blocks):
            t0 = time.perf_counter()
            cache, _ = attach(config, tier, "bench", "cpu", ahead_blocks=ahead, hot_blocks=args.hot_blocks,
                              free_on_close=i == len(args.ahead_blocks) - 1)
            attach_s = time.perf_counter() - t0
            store = cache.host
            attach_pulled = store.pulled_blocks
            step_s = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                forward_kv(cache, config, args.batch, 1, dtype, gen)
                cache.wait()
                step_s.append(time.perf_counter() - t0)
            stats = cache.stats.summary()
            runs.append({"ahead blocks/layer-step": ahead, "attach s": attach_s, "attach pulled": attach_pulled,
                         "median step ms (CPU)": median(step_s) * 1e3,
                         "pulled on demand/step": (store.pulled_blocks - attach_pulled) / args.steps,
                         "pulled ahead/step": store.ahead_pulled / args.steps,
                         "hot hits/step": store.hot_hits / args.steps,
                         "ahead hits/step": store.ahead_hits / args.steps,
                         "job pull s": store.pull_seconds, "job waits on ahead pulls s": store.net_wait_seconds,
                         "step_s": step_s, "fetched/layer-step": stats["fetched_blocks_per_layer_step"]})
            pulled = store.pulled_blocks - attach_pulled
            block_bytes = store.bytes_per_block()
            job_pull_s = store.pull_seconds
            decode_gpu = cache.device_nbytes()
            decode_host = store.nbytes
            if i < len(args.ahead_blocks) - 1:
                cache.close()

        # Direct batched gets of random prompt blocks (64 per call), into the hot cache's first entries.
        rng = random.Random(0)
        num_blocks = args.context // cfg.block_size
        layers = [layer.layer_idx for layer in cache.oasis_layers]
        buffer = torch.empty(64, block_bytes, dtype=torch.uint8)
        t0 = time.perf_counter()
        direct = 0
        while time.perf_counter() - t0 < 5.0:
            keys = [block_key("bench", rng.choice(layers), rng.randrange(num_blocks)) for _ in range(64)]
            tier.get(keys, [buffer[i].data_ptr() for i in range(64)], [block_bytes] * 64)
            direct += 64
        direct_s = time.perf_counter() - t0
        cache.close()
        prefill_tier.close()
        tier.close()

    per_seq = lambda n: n / args.batch / 2**20  # noqa: E731
    memory_rows = [
        {"decode node": "full KV: dense DynamicCache on the GPU", "GPU KV MiB/seq": per_seq(dense_gpu),
         "host MiB/seq": 0.0},
        {"decode node": "full KV: local OasisCache (host store)", "GPU KV MiB/seq": per_seq(decode_gpu),
         "host MiB/seq": per_seq(full_host)},
        {"decode node": "OasisKV attached to the remote tier", "GPU KV MiB/seq": per_seq(decode_gpu),
         "host MiB/seq": per_seq(decode_host)},
    ]
    for row in memory_rows:
        row["GPU KV vs dense"] = row["GPU KV MiB/seq"] / memory_rows[0]["GPU KV MiB/seq"]
        row["host vs full-KV host"] = row["host MiB/seq"] / memory_rows[1]["host MiB/seq"]
    bytes_per_step = pulled * block_bytes / args.steps
    loopback_gbs = pulled * block_bytes / max(job_pull_s - 0.0, 1e-9) / 1e9
    pull_rows = [
        {"pull": "decode jobs (batched per layer-step)", "blocks": pulled, "seconds": job_pull_s,
         "blocks/s": pulled / max(job_pull_s, 1e-9), "MB/s": pulled * block_bytes / max(job_pull_s, 1e-9) / 1e6},
        {"pull": "direct batched gets, 64 per call", "blocks": direct, "seconds": direct_s,
         "blocks/s": direct / direct_s, "MB/s": direct * block_bytes / direct_s / 1e6},
    ]
    lead_rows = []
    for name, gbs in [("loopback TCP, measured", loopback_gbs)] + [(f"{g:g} GB/s link", g) for g in
                                                                      args.bandwidths_gbs]:
        pull_ms = bytes_per_step / (gbs * 1e9) * 1e3
        row = {"network": name, "GB/s": gbs, "pull ms/step": pull_ms}
        for step_ms in args.step_ms:
            row[f"lead steps @ {step_ms:g} ms/step"] = max(1, math.ceil(pull_ms / step_ms))
        lead_rows.append(row)
    env = environment()
    header = (f"Test configuration: CPU ({env['python']}), torch {env['torch']}, Mooncake Store "
              f"(mooncake-transfer-engine-non-cuda) master + pool on loopback TCP; Llama-3.1-8B KV shape "
              f"(32 layers x 8 KV heads x 128, bf16), batch {args.batch}, context {args.context}, budget "
              f"{args.budget}, block {cfg.block_size} ({block_bytes / 1024:.0f} KiB per pool object: K and V of all "
              f"heads), lookahead selection from random queries (worst-case churn: "
              f"{runs[-1]['fetched/layer-step']:.0f} blocks fetched per layer-step); `{env['command']}`\n\n")
    table = (header + "Decode-node memory per sequence:\n\n"
             + markdown_table(memory_rows, ["decode node", "GPU KV MiB/seq", "GPU KV vs dense", "host MiB/seq",
                                            "host vs full-KV host"])
             + f"\n\nPartial pulls on demand ({pulled / args.steps:.0f} blocks = {bytes_per_step / 2**20:.1f} MiB per "
               f"decode step, last setting):\n\n"
             + markdown_table(pull_rows, ["pull", "blocks", "seconds", "blocks/s", "MB/s"])
             + "\n\nLead a prefetch needs to hide one step's pulls (each layer's job has one step until that layer "
               "runs again; a lead of k steps means selecting k steps ahead):\n\n"
             + markdown_table(lead_rows, ["network", "GB/s", "pull ms/step"]
                              + [f"lead steps @ {s:g} ms/step" for s in args.step_ms])
             + "\n\nNetwork prefetch (blocks per decode step, all layers; the last setting's pulls are the ones "
               "above):\n\n"
             + markdown_table(runs, ["ahead blocks/layer-step", "median step ms (CPU)", "pulled on demand/step",
                                     "pulled ahead/step", "hot hits/step", "ahead hits/step", "job pull s",
                                     "job waits on ahead pulls s", "attach s"])
             + f"\n\nPrefill fill {fill_s:.1f} s, publish {published / 2**20:.0f} MiB in {publish_s:.1f} s, attach "
               f"pulls the {runs[-1]['attach pulled']} resident blocks.")
    finish(args, table, {"env": env, "memory": memory_rows, "pulls": pull_rows, "lead": lead_rows, "runs": runs,
                         "publish_s": publish_s}, plot_remote_memory)


if __name__ == "__main__":
    main()
