"""How many blocks OasisKV's lookahead moves per layer-step on a real model: the delta rate the decode benchmark
replays on random-weight shapes (whose random attention moves the `max_fetch_blocks` cap every step).

    python -m eval.delta_rate --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --context 16384 --tasks recall_list qa --new-tokens 64 --out eval/results/delta_rate_qwen1.5b_16k

Each prompt (a task of the RULER-style suite, `eval.tasks.ruler`) is decoded greedily with the lookahead
selector under the decode benchmark's OasisKV configuration (the library defaults, budget 2048), twice: plain
decoding (one token per forward: the previous query scores) and `oasis_hf.speculative_generate` with the draft
model (the target's queries at the draft positions score). Reported per row: blocks fetched per (sequence, KV head)
and forward, per generated token, and the share of the budget's selected slots that changes per forward; with
``--selection-intervals`` (`OasisConfig.selection_interval`: a job after every Nth forward) also per job, the delta
one job moves (what `eval.bench_floor --variant ... selection_interval=N max_fetch_blocks=...` replays). A count,
not a time: it holds on any device (a CPU run in float32 picks what a bf16 GPU run picks up to near-ties).
``--config FIELD=VALUE ...`` measures a variant (e.g. ``keep_margin=0.5``); ``--draft none`` runs plain decoding only.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

import torch

import oasis_hf
from eval._common import code_identity, config_fields, finish, markdown_table
from eval.tasks import ruler
from oasis_hf import compat, models

logger = logging.getLogger("eval.delta_rate")

COLUMNS = ["task", "method", "selection_interval", "context", "new tokens", "forwards", "jobs",
           "blocks/(seq, head, forward)", "blocks/(seq, head, job)", "blocks/(seq, head, token)",
           "selected slots changed/forward", "draft acceptance", "seconds"]


@torch.inference_mode()
def measure(model, draft, input_ids, config: oasis_hf.OasisConfig, new_tokens: int, drafted: bool) -> dict:
    """Decode `new_tokens` with a fresh OasisCache of `config`; the fetch counters per forward and per token."""
    with oasis_hf.OasisCache(model.config, config) as cache:
        t0 = time.perf_counter()
        if drafted:
            out = oasis_hf.speculative_generate(model, draft, input_ids, cache=cache, max_new_tokens=new_tokens,
                                                num_draft_tokens=4)
            acceptance = out.stats.acceptance
        else:
            model.generate(input_ids, **{compat.cache_kwarg(model): cache}, max_new_tokens=new_tokens, do_sample=False,
                           min_new_tokens=new_tokens)
            acceptance = None
        seconds = time.perf_counter() - t0
        stats = cache.stats.summary()
        layer = cache.oasis_layers[0]
        pairs = layer.batch_size * layer.num_kv_heads
    forwards = stats["decode_layer_steps"] / len(cache.oasis_layers)
    jobs = stats["prefetch_jobs"] / len(cache.oasis_layers)
    per_forward = stats["fetched_blocks_per_layer_step"] / pairs
    selected = config.budget_blocks - config.sink_blocks - config.recent_blocks
    return {"forwards": forwards, "jobs": jobs, "blocks/(seq, head, forward)": per_forward,
            "blocks/(seq, head, job)": per_forward * forwards / jobs if jobs else None,
            "blocks/(seq, head, token)": per_forward * forwards / new_tokens,
            "selected slots changed/forward": per_forward / selected, "draft acceptance": acceptance,
            "seconds": seconds}


def main() -> None:
    code_identity()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                        help="draft model of the speculative rows; 'none': plain decoding only")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--tasks", nargs="+", default=["recall_list", "qa"], choices=sorted(ruler.TASKS))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--selection-intervals", type=int, nargs="+", default=[1],
                        help="OasisConfig.selection_interval values to measure (a job after every Nth forward)")
    parser.add_argument("--config", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="OasisConfig fields on top of the defaults, e.g. keep_margin=0.5 (what a variant moves)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    fields = config_fields(parser, args.config, [args.budget], rows=[("lookahead", {})],
                           reserved=("budget_tokens", "selector", "measure_recall", "selection_interval"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, tokenizer = models.load(args.model, device=args.device, dtype=dtype)
    draft = None if args.draft == "none" else models.load(args.draft, device=args.device, dtype=dtype)[0]
    oasis_hf.enable(model)
    config = oasis_hf.OasisConfig(budget_tokens=args.budget, selector="lookahead", **fields)
    rows = []
    for task in args.tasks:
        sample = ruler.generate(task, args.context, 1, tokenizer)[0]
        input_ids = tokenizer(sample["input"], return_tensors="pt")["input_ids"].to(args.device)
        for interval in args.selection_intervals:
            for drafted in (False, True) if draft is not None else (False,):
                method = "lookahead, draft model (speculative_generate)" if drafted else "lookahead, plain decoding"
                logger.info("%s: %s, selection_interval=%d ...", task, method, interval)
                row = {"task": task, "method": method, "selection_interval": interval, "context": input_ids.shape[1],
                       "new tokens": args.new_tokens}
                row.update(measure(model, draft, input_ids, dataclasses.replace(config, selection_interval=interval),
                                   args.new_tokens, drafted))
                rows.append(row)
                logger.info("%s", row)
    table = (f"Blocks moved by the lookahead selector, {args.model} with draft {args.draft} ({dtype}, "
             f"{args.device}), OasisConfig(budget_tokens={args.budget}, selector='lookahead'"
             + "".join(f", {name}={value!r}" for name, value in fields.items())
             + "), library defaults otherwise\n\n" + markdown_table(rows, COLUMNS))
    finish(args, table, {"oasis_config": config.to_dict(), "rows": rows})


if __name__ == "__main__":
    main()
