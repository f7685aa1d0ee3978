"""`eval.accuracy`'s result files: rows (one per method, budget and length), their union across runs and workers
with the provenance of every row kept, the summary and per-task tables with each row's GPU memory, and the report."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from eval._accuracy_methods import CHAT_SUFFIX, METHODS
from eval._common import environment, markdown_table, result_path, write_results
from eval.plot import plot_accuracy
from eval.tasks import TASKS
from oasis_hf.config import OasisConfig, blocks_for
from oasis_hf.kernels.ref import summary_key_vectors

logger = logging.getLogger("eval.accuracy")


def row_key(row: dict) -> tuple:
    return row["method"], row["budget"], row["length"]


def complete_row(row: dict) -> dict:
    """Set ``row["average"]`` (mean over the suite's tasks) once every task of the suite has a score in `row`;
    a row still missing tasks has no average (it is listed per task, left out of the summary and the plot)."""
    if all(task in row for task in TASKS):
        row["average"] = sum(row[task] for task in TASKS) / len(TASKS)
    return row


def merge_rows(*row_lists: list[dict]) -> list[dict]:
    """Rows of several runs, one per (method, budget, length): their task scores united (the first seen score of a
    task kept, with its wall time under ``seconds`` where recorded), the average set where the union covers every
    task."""
    merged: dict[tuple, dict] = {}
    for rows in row_lists:
        for row in rows:
            into = merged.setdefault(row_key(row), {k: row[k] for k in ("method", "budget", "length")})
            for task in TASKS:
                if task in row and task not in into:
                    into[task] = row[task]
                    for field in ("seconds", "batch_size"):
                        if task in row.get(field, {}):
                            into.setdefault(field, {})[task] = row[field][task]
            if "average" in row and not any(task in row for task in TASKS):  # a row written without its tasks
                into.setdefault("average", row["average"])
            for task, error in row.get("errors", {}).items():
                into.setdefault("errors", {}).setdefault(task, error)
    for row in merged.values():  # an error stays listed only where no run scored the task
        errors = {task: error for task, error in row.pop("errors", {}).items() if task not in row}
        if errors:
            row["errors"] = errors
    return [complete_row(row) for row in merged.values()]


def summarize(rows: list[dict]) -> list[dict]:
    """Per (method, budget): the average over the lengths measured so far (which ones, in ``lengths``)."""
    out: dict[tuple, dict] = {}
    for row in rows:
        if "average" not in row:  # tasks still missing
            continue
        entry = out.setdefault((row["method"], row["budget"]), {"method": row["method"], "budget": row["budget"],
                                                                 "scores": {}})
        entry["scores"][row.get("length", 0)] = row["average"]  # results from before per-length rows: 0
    return [{"method": e["method"], "budget": e["budget"],
             "average": sum(e["scores"].values()) / len(e["scores"]),
             "lengths": " ".join(str(n) for n in sorted(e["scores"])),
             **{f"@{n}": v for n, v in sorted(e["scores"].items())}} for e in out.values()]


def load_previous(args, preset: dict) -> list[dict]:
    """Rows of an earlier run at ``--out`` with the same model, draft and samples (``--resume``): a preset too large
    for one GPU session is finished over several, each adding the (length, method, budget) rows it has time for."""
    payload = read_result(args.out, preset) if args.out else None
    return payload["rows"] if payload else []


def read_result(out: Path, preset: dict) -> dict | None:
    """The result JSON at `out` (None if there is none), checked to have run the same model, draft and samples as
    `preset`: rows of different runs are only ever merged when they measured the same thing."""
    path = result_path(out, ".json")
    if not path.is_file():
        return None
    old = json.loads(path.read_text())
    for key in ("model", "draft", "samples"):
        if old["config"].get(key) != preset[key]:
            raise SystemExit(f"{path} was run with {key}={old['config'].get(key)!r}, this run has "
                             f"{preset[key]!r}; use another --out")
    return old


def carry_provenance(out: Path, payload: dict) -> dict:
    """A run that resumes a file keeps the provenance of the rows already there and adds itself to ``sources``:
    a file united from several runs (``--merge-from``) keeps its ``sources`` and ``relabelled``; a file written by
    one earlier run gets that run's environment as its first source. Rewriting the file never drops who measured
    its rows."""
    path = result_path(out, ".json")
    previous = json.loads(path.read_text()) if path.is_file() else {}
    earlier = previous.get("sources") or ([{"file": path.name, "env": previous["env"]}]
                                          if previous.get("rows") and previous.get("env") else [])
    if earlier:
        payload["sources"] = [*earlier, {"file": f"{path.name} (resumed)", "env": payload["env"]}]
    if previous.get("relabelled"):
        payload["relabelled"] = previous["relabelled"]
    return payload


def same_run(a: dict, b: dict) -> bool:
    """Whether two ``sources`` entries record the same process (its start time and command)."""
    return all(a["env"].get(k) == b["env"].get(k) for k in ("timestamp", "command"))


def merge_parts(args, preset: dict, files: list[Path], resume: bool, parts: int | None) -> list[dict]:
    """Unite the rows of the worker files `files` with ``--out``'s (where `resume`) and write ``--out``'s JSON,
    markdown and plot; returns the merged rows. ``parts=None``: the files are an earlier run's leftovers, so the
    environment recorded is theirs (the machine that measured), with this command under ``merged_by``."""
    payloads = [json.loads(path.read_text()) for path in files]
    rows = merge_rows(load_previous(args, preset) if resume else [], *(p["rows"] for p in payloads))
    env = environment() if parts is not None or not payloads else payloads[0]["env"]
    payload = {"env": env, "preset": args.preset, "config": preset, "rows": rows, "summary": summarize(rows),
               "parts": parts if parts is not None else len(files)}
    if parts is None:
        payload["merged_by"] = environment()["command"]
    if resume:
        carry_provenance(args.out, payload)
    write_merged(args, preset, payload)
    return rows


def merge_results(parser: argparse.ArgumentParser, args, preset: dict) -> list[dict]:
    """``--merge-from`` / ``--relabel``: rename --out's rows (``OLD=NEW``), unite the rows of other result files
    with them, and write --out's JSON, markdown and plot; returns the rows. The environment recorded stays --out's;
    every file's environment (the machine, command and source hash that measured its rows) is listed under
    ``sources``."""
    path = result_path(args.out, ".json")
    base = read_result(args.out, preset)
    if base is None:
        parser.error(f"--merge-from/--relabel: {path} does not exist")
    rows = base["rows"]
    relabelled = list(base.get("relabelled", []))
    for pair in args.relabel or []:
        old, sep, new = pair.partition("=")
        if not sep or not old or not new:
            parser.error(f"--relabel {pair!r}: write OLD=NEW")
        if not any(r["method"] == old for r in rows):
            parser.error(f"--relabel: {path} has no rows of method {old!r}")
        if any(r["method"] == new for r in rows):
            parser.error(f"--relabel: {path} already has rows of method {new!r}; relabel those first")
        for row in rows:
            if row["method"] == old:
                row["method"] = new
        relabelled.append({"from": old, "to": new, "by": environment()["command"]})
    sources = list(base.get("sources", [{"file": path.name, "env": base["env"]}]))
    others = []
    for other in args.merge_from or []:
        payload = read_result(other, preset)  # same model, draft and samples, or it stops
        if payload is None:
            parser.error(f"--merge-from: {result_path(other, '.json')} does not exist")
        other_rows = payload["rows"]
        clash = [(row_key(r), t) for r in other_rows for t in TASKS if t in r and t in
                 next((x for x in rows if row_key(x) == row_key(r)), {})]
        if clash:
            logger.warning("%s: %d (row, task) scores already in %s are kept from there: %s", other, len(clash),
                           path.name, clash[:5])
        others.append(other_rows)
        # A file that was itself resumed or united lists the runs that measured its rows under its own sources:
        # those carry over (once each), then the process that wrote it.
        name = result_path(other, ".json").name
        for entry in [*payload.get("sources", []), {"file": name, "env": payload["env"]}]:
            if not any(same_run(entry, seen) for seen in sources):
                sources.append(entry)
    merged = merge_rows(rows, *others)
    payload = {"env": base["env"], "preset": base.get("preset", args.preset), "config": base["config"],
               "rows": merged, "summary": summarize(merged), "parts": base.get("parts"), "sources": sources,
               # --report alone rewrites the markdown: the file's last merge stays its `merged_by`
               "merged_by": (environment()["command"] if args.merge_from or args.relabel
                             else base.get("merged_by") or environment()["command"])}
    if relabelled:
        payload["relabelled"] = relabelled
    write_merged(args, preset, payload)
    return merged


#: GPU memory columns of a row (MiB): per sequence, and the draft's weights, which a batch shares.
MEMORY = ("target KV MiB/seq", "summaries MiB/seq", "draft KV MiB/seq", "GPU total MiB/seq", "draft weights MiB")


def kv_shape(model) -> dict:
    """What `memory_columns` needs of a loaded model: full-attention layers, KV heads, head size, element bytes,
    parameter bytes."""
    from oasis_hf import compat

    config = compat.text_config(model.config)
    param = next(model.parameters())
    return {"layers": sum(t == "full_attention" for t in compat.layer_types(config)),
            "kv_heads": config.num_key_value_heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            "element_bytes": param.element_size(),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def memory_columns(row: dict, shapes: dict) -> dict:
    """GPU bytes a row's method keeps per sequence, in MiB: the target's KV (dense: the whole prompt; OasisKV: its
    pool of `budget` tokens; kvpress: the `budget` tokens left after compression, masked AdaKV keys not counted),
    OasisKV's block summaries, the draft model's KV of the whole prompt (it decodes densely), and the draft's
    weights (shared by a batch, so apart from the per-sequence total)."""
    fields = METHODS.get(row["method"].removesuffix(CHAT_SUFFIX))
    if fields is None:
        return {}
    target, length = shapes["model"], row["length"]
    per_token = 2 * target["layers"] * target["kv_heads"] * target["head_dim"] * target["element_bytes"]
    kept = length if fields.get("dense") else min(length, int(row["budget"]))
    # Layers with budgets of their own (`layer_budget_tokens`): each holds up to its budget instead of the row's.
    own = dict(fields.get("layer_budget_tokens") or {})
    kept += sum(min(length, int(tokens)) - kept for tokens in own.values()) / target["layers"]
    out = {"target KV MiB/seq": kept * per_token / 2**20}
    if not fields.get("dense") and "press" not in fields:
        default = OasisConfig()  # what a row that sets neither gets (OasisLM passes the library's defaults on)
        block = fields.get("block_size", default.block_size)
        keys = summary_key_vectors(fields.get("summary", default.summary), block)
        out["summaries MiB/seq"] = (keys * blocks_for(length, block) * per_token / 2) / 2**20
    draft = shapes.get("draft")
    if fields.get("draft") and draft:
        out["draft KV MiB/seq"] = (length * 2 * draft["layers"] * draft["kv_heads"] * draft["head_dim"]
                                   * draft["element_bytes"]) / 2**20
        out["draft weights MiB"] = draft["weight_bytes"] / 2**20
    out["GPU total MiB/seq"] = sum(v for k, v in out.items() if k.endswith("/seq"))
    return out


def tables(header: str, rows: list[dict], shapes: dict | None = None) -> str:
    """The summary table, then every row per task with its GPU memory per sequence (`memory_columns`) where the
    model shapes are known."""
    lengths = sorted({r["length"] for r in rows})
    table = header + "Suite average per method and budget (mean over the lengths measured):\n\n"
    table += markdown_table(summarize(rows), ["method", "budget", "average", "lengths"] + [f"@{n}" for n in lengths])
    table += "\n\nPer task, length, method and budget:\n\n"
    tasks = sorted({k for r in rows for k in r} - {"method", "budget", "length", "average", "seconds", "batch_size",
                                                     "errors", *MEMORY})
    errors = [f"- {r['method']} @{r['budget']}, {r['length']} tokens, {task}: `{error}`"
              for r in rows for task, error in sorted(r.get("errors", {}).items())]
    memory = []
    if shapes and shapes.get("model"):
        rows = [row | memory_columns(row, shapes) for row in rows]
        memory = [c for c in MEMORY if any(c in r for r in rows)]
    table += markdown_table(rows, ["method", "budget", "length", "average", *tasks, *memory])
    if memory:
        table += "\n\n" + bytes_table(rows)
    if errors:
        table += "\n\nTasks that raised (no score; `--resume` runs them again):\n\n" + "\n".join(errors) + "\n"
    return table


def bytes_table(rows: list[dict]) -> str:
    """Per length, the complete rows ordered by the GPU bytes they keep per sequence (`memory_columns`), each with the
    best average of any row that keeps no more: a row below that best loses to a cheaper one at equal bytes.
    `rows` carry their memory columns."""
    out = ("Suite average against GPU bytes per sequence, per length (complete rows, fewest bytes first; the draft's "
           "weights, shared by the batch, not included; `best at <= bytes`: the highest average of any row holding "
           "no more):\n\n")
    listed = []
    for length in sorted({r["length"] for r in rows}):
        ranked = sorted((r for r in rows if r["length"] == length and "average" in r and "GPU total MiB/seq" in r),
                        key=lambda r: (r["GPU total MiB/seq"], -r["average"]))
        best = -1.0
        for row in ranked:
            best = max(best, row["average"])
            listed.append({"length": length, "method": row["method"], "budget": row["budget"],
                           "GPU total MiB/seq": row["GPU total MiB/seq"], "average": row["average"],
                           "best at <= bytes": best})
    return out + markdown_table(listed, ["length", "method", "budget", "GPU total MiB/seq", "average",
                                         "best at <= bytes"])


def write_merged(args, preset: dict, payload: dict) -> None:
    env = payload["env"]
    if payload.get("merged_by"):  # an earlier run's worker files: `env` is one worker's (one GPU, its --part)
        files = f"{payload['parts']} worker file{'s' if payload['parts'] != 1 else ''}"
        last = (f"{files} of an earlier run, the first written by `{env['command']}`, "
                f"merged by `{payload['merged_by']}`")
    else:
        last = f"merged from {payload['parts']} worker processes; `{env['command']}`"
    if payload.get("sources"):
        last += " (the latest of the runs listed below)"
    header = (f"Test configuration: {env.get('gpu', 'cpu')} x {env.get('gpus', 1)}, torch {env['torch']}, "
              f"transformers {env['transformers']}; model {preset['model']}, draft {preset['draft']}; lengths "
              f"{sorted({r['length'] for r in payload['rows']})}, "
              f"{preset['samples']} samples per task and length; scores 0-100 (share of expected "
              f"strings in the answer); {last}\n\n")
    if payload.get("sources"):
        header += "Rows united from these runs (`eval.accuracy --merge-from`), each with the code that measured it:\n\n"
        header += "".join(f"- `{s['file']}`: {s['env'].get('gpu', 'cpu')}, source sha256 "
                          f"{str(s['env'].get('source_sha256', '?'))[:12]}, `{s['env'].get('command', '?')}`\n"
                          for s in payload["sources"])
        for by in dict.fromkeys(r["by"] for r in payload.get("relabelled", [])):
            pairs = [r for r in payload["relabelled"] if r["by"] == by]
            header += f"- renamed by `{by}`: " + "; ".join(f"`{r['from']}` -> `{r['to']}`" for r in pairs) + "\n"
        header += "\n"
    text = tables(header, payload["rows"], payload["config"].get("shapes"))
    print(text)
    write_results(args.out, payload, text)
    plot_accuracy(payload, args.out)


def report(args, preset: dict, model, rows: list[dict], lm_eval_version: str, final: bool) -> None:
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']},"
              f" lm-eval {lm_eval_version}; model {preset['model']} ({next(model.parameters()).dtype}), draft "
              f"{preset['draft']}; lengths {preset['lengths']}, {preset['samples']} samples per task and length; "
              f"scores 0-100 (share of expected strings in the answer); `{env['command']}`\n\n")
    summary = summarize(rows)
    table = tables(header, rows, preset.get("shapes"))
    if final:
        print(table)
    if args.out is not None:
        payload = {"env": env, "preset": args.preset, "config": preset, "rows": rows, "summary": summary}
        if args.resume and args.part is None:
            carry_provenance(args.out, payload)
        write_results(args.out, payload, table)
        if final and args.part is None:
            plot_accuracy(payload, args.out)
