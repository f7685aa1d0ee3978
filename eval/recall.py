"""Selection quality on a real model: share of the exact attention that falls on the resident blocks.

    python -m eval.recall --model smollm2-135m-instruct --context 2000 --budgets 256 512 --out eval/results/recall_x
    python -m eval.recall --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct --context 16000 \
        --budgets 2048 --trials 3 --out eval/results/recall_qwen_16k          # the lookahead issue's measurement

For each budget and selector, one greedy generation of the same pass-key prompt (varied filler, `oasis_hf.cli
.passkey_prompt`) with `OasisConfig(measure_recall=True)`: after every decode step of every layer the step's exact
attention (all keys read back from host memory) is compared with what was resident. Reports the attention mass on
resident blocks, the recall of the exact top-S blocks, and whether the pass key came out. ``lookahead`` runs with
prompt-lookup drafts (so its selection uses draft-position queries) and without (previous query).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

import oasis_hf
from eval._common import environment, markdown_table, write_results
from eval.plot import plot_vs_budget
from oasis_hf import models
from oasis_hf.cli import _run, passkey_prompt

logger = logging.getLogger("eval.recall")

METHODS = [  # (label, selector, prompt-lookup drafts, other OasisConfig fields)
    ("static (StreamingLLM)", "static", 0, {}),
    ("current-query (synchronous)", "current-query", 0, {}),
    ("previous-query", "previous-query", 0, {}),
    ("lookahead, no drafts", "lookahead", 0, {}),
    ("lookahead, prompt-lookup drafts (3)", "lookahead", 3, {}),
    ("lookahead, prompt-lookup drafts (3), rejected kept", "lookahead", 3, {"drop_rejected_drafts": False}),
    ("lookahead, draft model", "lookahead", "draft", {}),  # needs --draft
    ("oracle (exact, synchronous)", "oracle", 0, {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--trials", type=int, default=1, help="prompts (different seeds) per budget")
    parser.add_argument("--methods", nargs="+", default=None, help="labels (or label prefixes) to run; default all")
    parser.add_argument("--draft", default=None, help="assistant model for the 'lookahead, draft model' row")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tokenizer = models.load(args.model, device=args.device)
    draft = models.load(args.draft, device=args.device, dtype=model.dtype)[0] if args.draft else None
    oasis_hf.enable(model)
    rows = []
    for budget in args.budgets:
        for label, selector, lookup, fields in METHODS:
            if args.methods and not any(label.startswith(m) for m in args.methods):
                continue
            if lookup == "draft" and draft is None:
                continue
            mass, topk, correct, narrowed = [], [], 0, 0
            for trial in range(args.trials):
                prompt, key = passkey_prompt(args.context, tokenizer, seed=trial)
                config = oasis_hf.OasisConfig(budget_tokens=budget, selector=selector, measure_recall=True, **fields)
                with oasis_hf.OasisCache(model.config, config) as cache:
                    if lookup == "draft":
                        result = _run(model, tokenizer, prompt, cache, args.new_tokens, draft=draft)
                    else:
                        result = _run(model, tokenizer, prompt, cache, args.new_tokens, prompt_lookup=lookup)
                    stats = cache.stats.summary()
                narrowed += stats["narrowed_jobs"]
                if stats["recall_steps"]:  # a generation that ended in its first forward has no decode step
                    mass.append(stats["mass_recall"])
                    topk.append(stats["topk_recall"])
                correct += key in result["text"]
            mean_mass = sum(mass) / len(mass) if mass else "no decode step"
            logger.info("budget %d %s: mass %s", budget, label, mean_mass)
            rows.append({"budget": budget, "method": label, "attention mass on resident": mean_mass,
                         "oracle top-S recall": sum(topk) / len(topk) if topk else "no decode step",
                         "pass key found": f"{correct}/{args.trials}",
                         "jobs narrowed": narrowed})
            report(args, model, rows, final=False)  # a run cut short still leaves its finished rows
    report(args, model, rows, final=True)


def report(args, model, rows: list[dict], final: bool) -> None:
    """Write the table and JSON (and, once finished, print them and draw the figure)."""
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']};"
              f" model {args.model}, {next(model.parameters()).dtype}, pass-key prompt of about {args.context} "
              f"tokens, {args.new_tokens} greedy tokens, {args.trials} trial(s); `{env['command']}`\n\n")
    table = header + markdown_table(rows, ["budget", "method", "attention mass on resident", "oracle top-S recall",
                                           "pass key found", "jobs narrowed"])
    if final:
        print(table)
    if args.out is not None:
        payload = {"env": env, "args": vars(args) | {"out": str(args.out)}, "rows": rows}
        write_results(args.out, payload, table)
        if final:
            plot_recall(payload, args.out)


def plot_recall(payload: dict, path: Path) -> Path | None:
    """Attention mass on resident blocks against the budget, one line per method (PNG next to the table)."""
    return plot_vs_budget(payload["rows"], "attention mass on resident", path,
                          "exact attention mass on resident blocks",
                          f"{payload['args']['model']}, ~{payload['args']['context']}-token pass-key prompts")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
