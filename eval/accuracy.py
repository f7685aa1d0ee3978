"""Accuracy of OasisKV against dense and StreamingLLM on the RULER-style suite, through lm-eval.

    python -m eval.accuracy --preset cpu-smollm2-2k --out eval/results/accuracy_cpu_smollm2_2k

Generates the suite (`oasis_hf.tasks`) for the preset's model tokenizer, loads the model once, and runs every
(length, method, budget) through ``lm_eval.simple_evaluate`` with the ``oasis`` model (`OasisLM`), so all methods see
the same prompts under the same harness. Writes, after every such row, a markdown table (the suite average per
method and budget over the lengths measured, then every row per task, 0-100) and JSON; at the end a PNG (average
against the budget per method). ``--resume`` keeps the rows already written at ``--out`` and runs the others, so a
preset larger than one GPU session (``gpu-qwen-1.5b``: 22 method-budget pairs x 3 lengths x 9 tasks x 50 samples,
about 30,000 requests) is completed over several sessions, and ``--lengths/--budgets/--methods`` pick a part of it.

kvpress presses (SnapKV, expected attention) run through kvpress's own API at the same KV size (``budget`` prompt
tokens per layer and head); kvpress 0.5.5 needs a transformers that passes ``past_key_values`` to attention modules
(5.17 here; 5.18+ renamed it), and the runner says so instead of skipping the rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch

from eval._common import environment, markdown_table, write_results
from eval.plot import plot_vs_budget
from oasis_hf import models
from oasis_hf.tasks import TASKS, write_suite

logger = logging.getLogger("eval.accuracy")

# method label -> OasisLM keyword arguments (budget added per row; dense ignores it). ``batch_size=1``: the method
# generates one request at a time (transformers' prompt lookup, kvpress presses); the others take the preset's.
METHODS = {
    "dense": dict(dense=True),
    "static (StreamingLLM)": dict(selector="static"),
    "current-query": dict(selector="current-query"),
    "previous-query": dict(selector="previous-query"),
    "lookahead (prompt lookup 3)": dict(selector="lookahead", prompt_lookup=3, batch_size=1),
    "lookahead (draft model)": dict(selector="lookahead", draft=True),
    "kvpress SnapKV": dict(press="SnapKVPress", batch_size=1),
    "kvpress expected attention": dict(press="ExpectedAttentionPress", batch_size=1),
}

PRESETS = {
    "cpu-smollm2-2k": dict(model="smollm2-135m-instruct", draft=None, lengths=[2000], samples=3, budgets=[256, 512],
                           methods=["dense", "static (StreamingLLM)", "current-query", "previous-query",
                                    "lookahead (prompt lookup 3)"], batch_size=1),
    "gpu-qwen-1.5b": dict(model="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                          lengths=[8192, 16384, 30000], samples=50, budgets=[512, 1024, 2048], methods=list(METHODS),
                          batch_size=8),
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
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out's JSON (same model, draft and samples) and run the rest")
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
    rows = load_previous(args, preset) if args.resume else []
    done = {(r["method"], r["budget"], r["length"]) for r in rows}
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = models.load(preset["model"], device=device)
    draft = models.load(preset["draft"], device=device)[0] if preset["draft"] else None
    with tempfile.TemporaryDirectory(prefix="oasis_suite_") as tmp:
        suite = write_suite(tmp, tokenizer, preset["lengths"], preset["samples"])
        manager = TaskManager(include_path=str(suite))
        for length in preset["lengths"]:  # one harness call per (length, method, budget): each is a finished row
            tasks = [f"oasis_ruler_{task}_{length}" for task in TASKS]
            for method in preset["methods"]:
                fields = dict(METHODS[method])
                if fields.pop("draft", False):
                    fields["draft_model"] = draft
                batch_size = fields.pop("batch_size", preset["batch_size"])
                for budget in ([None] if fields.get("dense") else preset["budgets"]):
                    if (method, budget or "full", length) in done:
                        logger.info("%s @%s, %d tokens: in %s already", method, budget, length, args.out)
                        continue
                    lm = OasisLM(pretrained=model, tokenizer=tokenizer, budget=budget or 2048, device=device,
                                 batch_size=batch_size, **fields)
                    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager)
                    scores = {name.removeprefix("oasis_ruler_").removesuffix(f"_{length}"): value["score,none"]
                              for name, value in out["results"].items() if name in tasks}
                    row = {"method": method, "budget": budget or "full", "length": length,
                           "average": sum(scores.values()) / len(scores), **scores}
                    logger.info("%s @%s, %d tokens: %.1f", method, budget, length, row["average"])
                    rows.append(row)
                    report(args, preset, model, rows, lm_eval.__version__, final=False)
    report(args, preset, model, rows, lm_eval.__version__, final=True)


def load_previous(args, preset: dict) -> list[dict]:
    """Rows of an earlier run at ``--out`` with the same model, draft and samples (``--resume``): a preset too large
    for one GPU session is finished over several, each adding the (length, method, budget) rows it has time for."""
    path = args.out.with_suffix(".json") if args.out else None
    if path is None or not path.is_file():
        return []
    old = json.loads(path.read_text())
    for key in ("model", "draft", "samples"):
        if old["config"].get(key) != preset[key]:
            raise SystemExit(f"--resume: {path} was run with {key}={old['config'].get(key)!r}, this run has "
                             f"{preset[key]!r}; use another --out")
    return old["rows"]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (method, budget): the average over the lengths measured so far (which ones, in ``lengths``)."""
    out: dict[tuple, dict] = {}
    for row in rows:
        entry = out.setdefault((row["method"], row["budget"]), {"method": row["method"], "budget": row["budget"],
                                                                 "scores": {}})
        entry["scores"][row.get("length", 0)] = row["average"]  # results from before per-length rows: 0
    return [{"method": e["method"], "budget": e["budget"],
             "average": sum(e["scores"].values()) / len(e["scores"]),
             "lengths": " ".join(str(n) for n in sorted(e["scores"])),
             **{f"@{n}": v for n, v in sorted(e["scores"].items())}} for e in out.values()]


def report(args, preset: dict, model, rows: list[dict], lm_eval_version: str, final: bool) -> None:
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']},"
              f" lm-eval {lm_eval_version}; model {preset['model']} ({next(model.parameters()).dtype}), draft "
              f"{preset['draft']}; lengths {preset['lengths']}, {preset['samples']} samples per task and length; "
              f"scores 0-100 (share of expected strings in the answer); `{env['command']}`\n\n")
    summary = summarize(rows)
    lengths = sorted({r["length"] for r in rows})
    table = header + "Suite average per method and budget (mean over the lengths measured):\n\n"
    table += markdown_table(summary, ["method", "budget", "average", "lengths"] + [f"@{n}" for n in lengths])
    table += "\n\nPer task, length, method and budget:\n\n"
    tasks = sorted({k for r in rows for k in r} - {"method", "budget", "length", "average"})
    table += markdown_table(rows, ["method", "budget", "length", "average", *tasks])
    if final:
        print(table)
    if args.out is not None:
        payload = {"env": env, "preset": args.preset, "config": preset, "rows": rows, "summary": summary}
        write_results(args.out, payload, table)
        if final:
            plot_accuracy(payload, args.out)


def plot_accuracy(payload: dict, path: Path) -> Path | None:
    """Suite average against the budget, one line per method; dense as a horizontal line."""
    rows = payload.get("summary") or summarize(payload["rows"])
    return plot_vs_budget(rows, "average", path, "suite average (0-100)",
                          f"{payload['config']['model']}, lengths {payload['config']['lengths']}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
