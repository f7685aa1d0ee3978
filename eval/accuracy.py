"""Accuracy of OasisKV against dense and StreamingLLM on the RULER-style suite, through lm-eval.

    python -m eval.accuracy --preset cpu-smollm2-2k --out eval/results/accuracy_cpu_smollm2_2k

Generates the suite (`oasis_hf.tasks`) for the preset's model tokenizer, loads the model once, and runs every
(method, budget) through ``lm_eval.simple_evaluate`` with the ``oasis`` model (`OasisLM`), so all methods see the
same prompts under the same harness. Writes a markdown table (per task and the suite average, 0-100), JSON and a
PNG (average accuracy against the budget per method).

kvpress presses (SnapKV, expected attention) run through kvpress's own API at the same KV size (``budget`` prompt
tokens per layer and head); kvpress 0.5.5 needs a transformers that passes ``past_key_values`` to attention modules
(5.17 here; 5.18+ renamed it), and the runner says so instead of skipping the rows.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import torch

from eval._common import environment, markdown_table, write_results
from eval.plot import plot_vs_budget
from oasis_hf import models
from oasis_hf.tasks import write_suite

logger = logging.getLogger("eval.accuracy")

# method label -> OasisLM keyword arguments (budget added per row; dense ignores it)
METHODS = {
    "dense": dict(dense=True),
    "static (StreamingLLM)": dict(selector="static"),
    "current-query": dict(selector="current-query"),
    "previous-query": dict(selector="previous-query"),
    "lookahead (prompt lookup 3)": dict(selector="lookahead", prompt_lookup=3),
    "lookahead (draft model)": dict(selector="lookahead", draft=True),
    "kvpress SnapKV": dict(press="SnapKVPress"),
    "kvpress expected attention": dict(press="ExpectedAttentionPress"),
}

PRESETS = {
    "cpu-smollm2-2k": dict(model="smollm2-135m-instruct", draft=None, lengths=[2000], samples=3, budgets=[256, 512],
                           methods=["dense", "static (StreamingLLM)", "current-query", "previous-query",
                                    "lookahead (prompt lookup 3)"], batch_size=1),
    "gpu-qwen-1.5b": dict(model="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                          lengths=[8192, 16384, 30000], samples=50, budgets=[512, 1024, 2048], methods=list(METHODS),
                          batch_size=1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smollm2-2k")
    parser.add_argument("--samples", type=int, default=None, help="override the preset's samples per task")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="override the preset's context lengths")
    parser.add_argument("--budgets", type=int, nargs="+", default=None, help="override the preset's budgets")
    parser.add_argument("--methods", nargs="+", default=None, choices=sorted(METHODS), metavar="METHOD",
                        help=f"override the preset's methods; any of {sorted(METHODS)}")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from oasis_hf.integrations.lm_eval import OasisLM

    preset = dict(PRESETS[args.preset])
    for key in ("samples", "lengths", "budgets", "methods"):
        if getattr(args, key):
            preset[key] = getattr(args, key)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = models.load(preset["model"], device=device)
    draft = models.load(preset["draft"], device=device)[0] if preset["draft"] else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="oasis_suite_") as tmp:
        suite = write_suite(tmp, tokenizer, preset["lengths"], preset["samples"])
        manager = TaskManager(include_path=str(suite))
        for method in preset["methods"]:
            fields = dict(METHODS[method])
            for budget in ([None] if fields.get("dense") else preset["budgets"]):
                if fields.pop("draft", False):
                    fields["draft_model"] = draft
                lm = OasisLM(pretrained=model, tokenizer=tokenizer, budget=budget or 2048, device=device,
                             batch_size=preset["batch_size"], **fields)
                out = lm_eval.simple_evaluate(model=lm, tasks=["oasis_ruler"], task_manager=manager)
                scores = {name: value["score,none"] for name, value in out["results"].items()
                          if name.startswith("oasis_ruler_")}
                row = {"method": method, "budget": budget or "full", "average": sum(scores.values()) / len(scores)}
                row.update({name.removeprefix("oasis_ruler_"): score for name, score in scores.items()})
                logger.info("%s @%s: %.1f", method, budget, row["average"])
                rows.append(row)
    env = environment()
    columns = ["method", "budget", "average"] + sorted({k for r in rows for k in r} - {"method", "budget", "average"})
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']},"
              f" lm-eval {lm_eval.__version__}; model {preset['model']} ({next(model.parameters()).dtype}), draft "
              f"{preset['draft']}; lengths {preset['lengths']}, {preset['samples']} samples per task and length; "
              f"scores 0-100 (share of expected strings in the answer); `{env['command']}`\n\n")
    table = header + markdown_table(rows, columns)
    print(table)
    if args.out is not None:
        payload = {"env": env, "preset": args.preset, "config": preset, "rows": rows}
        write_results(args.out, payload, table)
        plot_accuracy(payload, args.out)


def plot_accuracy(payload: dict, path: Path) -> Path | None:
    """Suite average against the budget, one line per method; dense as a horizontal line."""
    return plot_vs_budget(payload["rows"], "average", path, "suite average (0-100)",
                          f"{payload['config']['model']}, lengths {payload['config']['lengths']}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
