"""Selection quality on a real model: share of the exact attention that falls on the resident blocks.

    python -m eval.recall --model smollm2-135m-instruct --context 2000 --budgets 256 512 --out eval/results/recall_x
    python -m eval.recall --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --context 16000 \
        --budgets 2048 --trials 3 --out eval/results/recall_qwen_16k          # the lookahead issue's measurement

For each budget, decoding loop and selector, one greedy generation of the same pass-key prompts (varied filler,
`oasis_hf.cli.passkey_prompt`; or, with ``--task``, prompts of one task of the accuracy suite, to see where a task's
points go) with `OasisConfig(measure_recall=True)`: after every decode step of every layer the
step's exact attention (all keys read back from host memory) is compared with what was resident. Reports the
attention mass on resident blocks, the recall of the exact top-S blocks (over all of the forward's queries), whether
the pass key came out, and the blocks fetched per (KV head, layer-step), with those of the in-step correction
(`OasisConfig.sync_fetch_blocks`) apart, to set against the caps that random K/V fills at every step.

Selectors are compared within a decoding loop (`LOOPS`): plain greedy decoding (one query per forward, where
``lookahead`` has no drafts and equals ``previous-query``), HF prompt lookup, and `oasis_hf.speculative_generate`
with a draft model (``--draft``). Under the last two, ``lookahead`` scores the next step's blocks with every
verify query (the drafts' included), ``previous-query`` with the first one only.

``--config FIELD=VALUE ...`` sets `OasisConfig` fields for every row, e.g. the accuracy preset's selection setting
(``block_size=16 sink_tokens=16 recent_tokens=64 prefill_window_tokens=32 score_decay=0.9``), so that a variant can be
compared on a suite task's prompts on the CPU before it costs GPU time.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

import oasis_hf
from eval._common import code_identity, config_fields, environment, markdown_table, write_results
from eval.plot import plot_recall
from eval.tasks import TASKS
from eval.tasks.ruler import generate as task_samples
from eval.tasks.ruler import string_match_all
from oasis_hf import models
from oasis_hf.cli import greedy_text, passkey_prompt

logger = logging.getLogger("eval.recall")

SELECTORS = [  # (label, selector, other OasisConfig fields)
    ("static (StreamingLLM)", "static", {}),
    ("current-query (synchronous)", "current-query", {}),
    ("previous-query", "previous-query", {}),
    ("lookahead", "lookahead", {}),
    ("current-query, minmax summaries", "current-query", {"summary": "minmax"}),
    ("lookahead, minmax summaries", "lookahead", {"summary": "minmax"}),
    ("lookahead, mean+minmax summaries", "lookahead", {"summary": "mean+minmax"}),
    ("current-query, quantized keys", "current-query", {"summary": "quantized"}),
    ("lookahead, quantized keys", "lookahead", {"summary": "quantized"}),
    ("oracle (exact, synchronous)", "oracle", {}),
]
FETCHED = "fetched blocks/(head, layer-step)"
CORRECTED = "of which in-step correction"
# How the tokens are produced. The oracle set of a forward is the exact top-S of all its queries' attention, so
# selectors are compared within one decoding loop: across loops the forwards (1 query, or 1 + drafts) differ.
LOOPS = {
    "greedy": "plain greedy decoding (one query per forward; lookahead is previous-query here)",
    "prompt-lookup": "HF generate with prompt_lookup_num_tokens=3 (verify forwards of up to 4 queries)",
    "draft": "oasis_hf.speculative_generate with the draft model, 4 drafts per round (verify forwards of 5 queries)",
}


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--trials", type=int, default=1, help="prompts (different seeds) per budget")
    parser.add_argument("--task", default=None, choices=sorted(TASKS),
                        help="prompts from this task of the accuracy suite (`eval.tasks`, at --context tokens; "
                             "'found' is then its score 0-1) instead of the pass-key prompt")
    parser.add_argument("--methods", nargs="+", default=None, help="labels (or label prefixes) to run; default all")
    parser.add_argument("--loops", nargs="+", default=None, choices=sorted(LOOPS),
                        help="decoding loops to run (default: greedy and prompt-lookup, and draft with --draft)")
    parser.add_argument("--draft", default=None, help="draft model for the 'draft' loop")
    parser.add_argument("--draft-tokens", type=int, default=4, help="drafts per round in the 'draft' loop")
    parser.add_argument("--config", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="OasisConfig fields for every row, e.g. the accuracy preset's selection setting: "
                             "block_size=16 sink_tokens=16 recent_tokens=64 prefill_window_tokens=32 score_decay=0.9 "
                             "(a row's own fields, such as its summary, win)")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME FIELD=VALUE",
                        help="also run every row with these OasisConfig fields on top of --config, labelled "
                             "'<method> [NAME]' (repeatable), e.g. --variant layers "
                             "'layer_budget_tokens={\"0\": 480, \"5\": 160}'; the plain rows run too")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    chosen = [(selector, fields) for label, selector, fields in SELECTORS
              if not args.methods or any(label.startswith(m) for m in args.methods)]
    args.config = config_fields(parser, args.config, args.budgets, rows=chosen)
    variants = {"": {}}
    for name, *pairs in args.variant:
        if name in variants or "=" in name or not pairs:
            parser.error(f"--variant {name!r}: write a new NAME, then FIELD=VALUE pairs")
        variants[name] = config_fields(parser, pairs, args.budgets, base=args.config, rows=chosen)
    args.variant = {name: fields for name, fields in variants.items() if name}
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loops = args.loops or ["greedy", "prompt-lookup"] + (["draft"] if args.draft else [])
    if "draft" in loops and not args.draft:
        parser.error("--loops draft needs --draft MODEL")
    model, tokenizer = models.load(args.model, device=args.device)
    draft = models.load(args.draft, device=args.device, dtype=model.dtype)[0] if args.draft else None
    oasis_hf.enable(model)
    rows = []
    for budget in args.budgets:
        for loop in loops:
            for label, selector, fields in SELECTORS:
                if args.methods and not any(label.startswith(m) for m in args.methods):
                    continue
                if loop == "greedy" and selector == "lookahead":
                    continue  # identical to previous-query with one query per forward
                for name, extra in variants.items():
                    named = f"{label} [{name}]" if name else label
                    rows.append(run_row(args, model, tokenizer, draft, budget, loop, named, selector,
                                        fields | extra))
                    report(args, model, rows, final=False)  # a run cut short still leaves its finished rows
    report(args, model, rows, final=True)


def run_row(args, model, tokenizer, draft, budget: int, loop: str, label: str, selector: str, fields: dict) -> dict:
    """One selector under one decoding loop, over ``--trials`` prompts: mean attention mass and top-S recall."""
    mass, topk, correct, narrowed = [], [], 0.0, 0
    moved = {"fetched": 0.0, "corrected": 0.0, "steps": 0}  # blocks, and (KV head, layer-step) pairs
    layer_mass: dict[int, list[float]] = {}
    layer_topk: dict[int, list[float]] = {}
    samples = task_samples(args.task, args.context, args.trials, tokenizer) if args.task else None
    for trial in range(args.trials):
        if samples:
            prompt, expected = samples[trial]["input"], samples[trial]["outputs"]
        else:
            prompt, key = passkey_prompt(args.context, tokenizer, seed=trial)
            expected = [key]
        config = oasis_hf.OasisConfig(budget_tokens=budget, selector=selector, measure_recall=True,
                                      **args.config | fields)
        with oasis_hf.OasisCache(model.config, config) as cache:
            if loop == "draft":
                text = _speculative(model, draft, tokenizer, prompt, cache, args.new_tokens, args.draft_tokens)
            else:
                text = greedy_text(model, tokenizer, prompt, cache, args.new_tokens,
                            prompt_lookup=3 if loop == "prompt-lookup" else 0)["text"]
            stats = cache.stats.summary()
        narrowed += stats["narrowed_jobs"]
        moved["fetched"] += stats["fetched_blocks"]
        moved["corrected"] += stats["corrected_blocks"]
        moved["steps"] += stats["decode_layer_steps"] * model.config.num_key_value_heads
        if stats["recall_steps"]:  # a generation that ended in its first forward has no decode step
            mass.append(stats["mass_recall"])
            topk.append(stats["topk_recall"])
            for idx, value in stats["layer_mass_recall"].items():
                layer_mass.setdefault(idx, []).append(value)
            for idx, value in stats["layer_topk_recall"].items():
                layer_topk.setdefault(idx, []).append(value)
        correct += string_match_all(text, expected)
    mean_mass = sum(mass) / len(mass) if mass else "no decode step"
    logger.info("budget %d, %s loop, %s: mass %s", budget, loop, label, mean_mass)
    return {"budget": budget, "decoding": loop, "method": label, "attention mass on resident": mean_mass,
            "oracle top-S recall": sum(topk) / len(topk) if topk else "no decode step",
            found_column(args): f"{correct:g}/{args.trials}", "jobs narrowed": narrowed,
            # Per (KV head, layer-step), the unit of `max_fetch_blocks` and `sync_fetch_blocks`: all fetched blocks,
            # and those of the in-step correction alone (one sequence: the prompts run at batch 1).
            FETCHED: moved["fetched"] / max(1, moved["steps"]), CORRECTED: moved["corrected"] / max(1, moved["steps"]),
            # Per layer index, averaged over the trials: where the selection loses attention (`report`'s second table).
            "layer mass": {i: sum(v) / len(v) for i, v in sorted(layer_mass.items())},
            "layer top-S recall": {i: sum(v) / len(v) for i, v in sorted(layer_topk.items())}}


def found_column(args) -> str:
    """The answer column: pass keys found, or with ``--task`` the task's score summed over the trials (each 0-1)."""
    return f"{args.task} score" if args.task else "pass key found"


def _speculative(model, draft, tokenizer, prompt: str, cache, new_tokens: int, draft_tokens: int) -> str:
    """Greedy `speculative_generate` of `prompt` with `draft`, the target on `cache`; returns the new text."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    eos = tokenizer.eos_token_id
    out = oasis_hf.speculative_generate(model, draft, inputs["input_ids"], inputs["attention_mask"], cache=cache,
                                        max_new_tokens=new_tokens, num_draft_tokens=draft_tokens, eos_token_id=eos,
                                        pad_token_id=tokenizer.pad_token_id or eos)
    return tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def layer_table(rows: list[dict]) -> str:
    """Oracle top-S recall per layer (rows) and measured row (columns), as markdown; empty without measurements."""
    measured = [row for row in rows if row.get("layer top-S recall")]
    if not measured:
        return ""
    layers = sorted({i for row in measured for i in row["layer top-S recall"]})
    names = [f"{row['method']} @{row['budget']} ({row['decoding']})" for row in measured]
    lines = ["", "", "Oracle top-S recall per layer:", "", "| layer | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for i in layers:
        cells = [f"{row['layer top-S recall'][i]:.3f}" if i in row["layer top-S recall"] else "" for row in measured]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(args, model, rows: list[dict], final: bool) -> None:
    """Write the table and JSON (and, once finished, print them and draw the figure)."""
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']};"
              f" model {args.model}, {next(model.parameters()).dtype}, "
              f"{f'{args.task} prompts' if args.task else 'pass-key prompt'} of about {args.context} "
              f"tokens, {args.new_tokens} greedy tokens, {args.trials} trial(s)"
              f"{''.join(f', {k}={v}' for k, v in args.config.items())}; `{env['command']}`\n\n")
    header += "".join(f"- `{loop}`: {what}\n" for loop, what in LOOPS.items()
                      if any(row["decoding"] == loop for row in rows))
    header += "".join(f"- `[{name}]`: {', '.join(f'{k}={v}' for k, v in fields.items())}\n"
                      for name, fields in args.variant.items()) + "\n"
    columns = ["budget", "decoding", "method", "attention mass on resident", "oracle top-S recall", found_column(args),
               "jobs narrowed", FETCHED, CORRECTED]
    table = header + markdown_table(rows, columns) + layer_table(rows)
    if final:
        print(table)
    if args.out is not None:
        payload = {"env": env, "args": vars(args) | {"out": str(args.out)}, "rows": rows}
        write_results(args.out, payload, table)
        if final:
            plot_recall(payload, args.out)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
