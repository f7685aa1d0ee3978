"""Accuracy of OasisKV against dense and StreamingLLM on the RULER-style suite, through lm-eval.

    python -m eval.accuracy --preset cpu-smollm2-2k-quick --out eval/results/accuracy_cpu_smollm2_2k_quick  # ~6 min
    python -m eval.accuracy --preset cpu-smollm2-2k --out eval/results/accuracy_cpu_smollm2_2k

Generates the suite (`eval.tasks`) for the preset's model tokenizer, loads the model once, and runs every
(length, method, budget, task) through ``lm_eval.simple_evaluate`` with the ``oasis`` model (`OasisLM`), so all
methods see the same prompts under the same harness. Writes, after every task, a markdown table (the suite average
per method and budget over the lengths measured, then every (length, method, budget) row per task, 0-100) and JSON;
at the end a PNG (average against the budget per method). A row's average appears once all its tasks are in; rows
still missing tasks are listed per task and left out of the summary. ``--resume`` keeps the task scores already
written at ``--out`` and runs the others (a time limit loses at most the tasks in flight; with ``--time-budget`` a
task starts only if its row's earlier tasks say it ends in time), so a
preset larger than one GPU session (``gpu-qwen-1.5b``: 22 method-budget pairs x 3 lengths x 9 tasks x 50 samples,
about 30,000 requests) is completed over several sessions, and ``--lengths/--budgets/--methods`` pick a part of it.
On CUDA the OasisKV rows decode through whole-model CUDA graphs (`oasis_hf.decode_generate`, or
``speculative_generate(target_graphs=True)`` with drafts: the same greedy tokens as ``generate``, tested, at a fraction
of the host time per step), and the kvpress rows decode their compressed cache with each step a CUDA graph
(`eval.static_decode.greedy_continue`, after kvpress's compressed prefill); ``--eager`` uses
transformers' ``generate`` for both instead. Dense rows always use ``generate``.

``--parts N`` runs the preset as N worker processes (worker K on GPU K modulo the GPUs there are) that claim rows from a
shared list as they go (a (row, task)'s claim is a file created exclusively under ``<out>.claims/``), each writing its
own ``<out>.partK`` files, then merges them into ``--out``: on an 8-GPU machine the 30,000 requests take about an
eighth of the time. A task whose harness call raises (an out-of-memory, a press that cannot run) is recorded under
its row's ``errors`` and listed under the table; the worker goes on with its other tasks and exits non-zero at the end.
A task that ran out of GPU memory (workers sharing a GPU whose peaks met) is tried once more after the worker's
other tasks, and counts as failed only if that fails too.
A worker that dies leaves its claimed task undone. ``--resume`` runs both kinds again.

Lengths beyond the model's trained window run with YaRN rope scaling, as the model card describes, target and draft
alike (`eval._harness.yarn_context`); the rows at shorter lengths run the model as trained. The factor is the
smallest power of two that covers the prompt plus the longest answer (160 tokens) and a margin of 64: ``--lengths
64000`` on Qwen2.5's 32,768 positions takes factor 2 (the model card's setting), ``--lengths 65536`` would take 4.

kvpress presses run through kvpress's own API at the same KV size (`eval.press_baselines`): under kvpress's
protocols, query-agnostic (the context compressed, the question and the answer cue prefilled after it) or query-aware
(context and question compressed, the cue after them), the uncompressed tail counted inside the budget; SnapKV, AdaKV
SnapKV, expected attention both plain and as kvpress's benchmark registry runs it (AdaKV, epsilon 1e-2), and
Compactor (query-agnostic, its design).
kvpress 0.5.5 needs a transformers that passes ``past_key_values`` to attention modules (5.17 here; 5.18+ renamed
it), and the runner says so instead of skipping the rows. Every row's table line gives the GPU memory its method
keeps per sequence (`memory_columns`: the target's KV, OasisKV's summaries, the draft's KV) and the draft's weights.

The rows and presets are in `eval._accuracy_methods`; the result files (rows united across runs and workers with
their provenance, the tables, the report) in `eval._accuracy_results`; this module runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from eval._accuracy_methods import CHAT_SUFFIX, METHODS, PRESETS, preset_of
from eval._accuracy_results import (
    complete_row,
    kv_shape,
    load_previous,
    merge_parts,
    merge_results,
    report,
    row_key,
)
from eval._common import code_identity, without_option
from eval._harness import yarn_context
from eval.tasks import TASKS, relocate_suite, write_suite
from oasis_hf import models

logger = logging.getLogger("eval.accuracy")


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smollm2-2k")
    parser.add_argument("--samples", type=int, default=None, help="override the preset's samples per task")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="override the preset's context lengths")
    parser.add_argument("--budgets", type=int, nargs="+", default=None, help="override the preset's budgets")
    parser.add_argument("--methods", nargs="+", default=None, choices=sorted(METHODS), metavar="METHOD",
                        help=f"override the preset's methods; any of {sorted(METHODS)}")
    parser.add_argument("--tasks", nargs="+", default=None, choices=sorted(TASKS), metavar="TASK",
                        help="run only these tasks of the suite (rows then stay partial: no average)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in --out's JSON (same model, draft and samples) and run the rest")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-size", type=int, default=None, metavar="N",
                        help="requests per generate call for the methods that set none (the preset's otherwise), "
                             "e.g. 4 to fit dense at 64k beside other workers: its padded prefill mask grows with "
                             "batch x length^2; recorded per task under 'batch_size'")
    parser.add_argument("--eager", action="store_true",
                        help="decode OasisKV rows with transformers' generate (per-layer graphs) instead of "
                             "whole-model CUDA graphs (`decode_generate`; same tokens, default on CUDA)")
    parser.add_argument("--parts", type=int, default=None,
                        help="run as this many worker processes (round-robin over the GPUs), then merge")
    parser.add_argument("--part", type=int, default=None, help=argparse.SUPPRESS)  # a worker of --parts
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="wall seconds this run may take: a task is started only if it is expected to end within "
                             "them (its row's task times at this length, measured in this run or recorded in --out), "
                             "so a run under a hard time limit (`timeout`) loses no task in flight to it")
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # epoch seconds, --parts sets
    parser.add_argument("--merge", action="store_true",
                        help="only merge the worker files a stopped --parts run left next to --out into --out "
                             "(report and plot included); runs nothing (a --parts run also does this first)")
    parser.add_argument("--merge-from", type=Path, nargs="+", default=None, metavar="JSON",
                        help="unite the rows of these result files (same model, draft and samples; rows from several "
                             "sessions or machines) into --out, recording each file's environment under 'sources'; "
                             "runs nothing. On a (row, task) both hold, --out's score is kept")
    parser.add_argument("--relabel", nargs="+", default=None, metavar="OLD=NEW",
                        help="with --merge-from (or alone): rename --out's rows of method OLD to NEW first (when a "
                             "method's definition in METHODS changes, its earlier rows keep a name that says what "
                             "they ran); recorded under 'relabelled'")
    parser.add_argument("--chat-template", action="store_true",
                        help="wrap every prompt in the model's chat template (lm-eval's apply_chat_template); the rows "
                             f"are labelled '<method>{CHAT_SUFFIX}' (a sensitivity check of the plain-prompt rows)")
    parser.add_argument("--report", action="store_true",
                        help="only rewrite --out's markdown and plot from its JSON (after the table layout or the "
                             "memory columns changed); runs nothing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error(f"--time-budget {args.time_budget}: give a positive number of seconds")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: give a positive number of requests")
    if args.deadline is None and args.time_budget is not None:
        args.deadline = time.time() + args.time_budget  # the workers of --parts inherit it (worker_argv)
    if args.merge_from or args.relabel or args.report:
        if args.out is None:
            parser.error("--merge-from/--relabel/--report need --out")
        merge_results(parser, args, preset_of(args))
        return
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        merge_parts(args, preset_of(args), part_files(args.out), resume=True, parts=None)
        clear_worker_files(args.out)  # merged: the rows are in --out now
        return
    drafted = [m for m in preset_of(args)["methods"] if METHODS[m].get("draft")]
    if drafted and not PRESETS[args.preset]["draft"]:
        parser.error(f"{drafted} need a draft model and preset {args.preset!r} names none")
    if args.parts is not None:
        run_parts(parser, args)
        return
    import lm_eval
    from lm_eval.tasks import TaskManager

    from eval.press_baselines import PressLM
    from oasis_hf.integrations.lm_eval import OasisLM

    preset = preset_of(args)
    rows = load_previous(args, preset) if args.resume else []
    previous = {row_key(r): r for r in rows}  # what --out holds: its tasks are not run again
    if args.part is not None:  # a worker: the merged rows are the parent's; this one writes only its own
        rows, args.out = [], part_path(args.out, args.part)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset["whole_step_graphs"] = device.startswith("cuda") and not args.eager
    model, tokenizer = models.load(preset["model"], device=device)
    preset["shapes"] = {"model": kv_shape(model)}
    draft = None  # loaded by the first row that runs with it: a run of baseline rows never reads its weights
    suite = cached_suite(tokenizer, preset["model"], preset["lengths"], preset["samples"])
    manager = TaskManager(include_path=[str(folder) for folder in suite])
    failed: list[str] = []  # tasks that raised: recorded in their rows, reported at the end
    taken: dict[tuple[str, int], list[float]] = {}  # (label, length) -> seconds of the tasks this run finished
    # One harness call per (length, method, budget, task): each finished task is written at once, so a time
    # limit loses at most the task in flight, and a row's average appears when all its tasks are in.
    # A task that runs out of GPU memory (--parts workers share one GPU, and their peaks can meet) is tried once more
    # after this worker's other tasks, when the others may have finished: the second pass runs only those.
    retry: set[tuple] = set()  # (label, budget, length, task)
    for second_pass in (False, True):
        if second_pass and not retry:
            break
        if second_pass:
            logger.info("%d task(s) ran out of GPU memory: trying them once more", len(retry))
        for length in preset["lengths"]:
            # Beyond the model's trained window (64k for Qwen2.5's 32k), YaRN as its model card describes: target and
            # draft alike, for this length's rows only.
            need = length + max(TASKS[t][1] for t in TASKS) + 64
            with contextlib.ExitStack() as stretched:
                stretched.enter_context(yarn_context(model, need))
                if draft is not None:
                    stretched.enter_context(yarn_context(draft, need))
                for method in preset["methods"]:
                    fields = dict(METHODS[method])
                    needs_draft = fields.pop("draft", False)
                    batch_size = fields.pop("batch_size", args.batch_size or preset["batch_size"])
                    for budget in ([None] if fields.get("dense") else preset["budgets"]):
                        label = method + CHAT_SUFFIX if args.chat_template else method
                        key = (label, budget or "full", length)
                        todo = [t for t in args.tasks or TASKS if t not in previous.get(key, {})
                                and (not second_pass or (*key, t) in retry)]
                        if not todo:
                            if not second_pass:
                                logger.info("%s @%s, %d tokens: in %s already", method, budget, length, args.out)
                            continue
                        lm = None
                        for task in todo:
                            expected = expected_seconds(taken, previous, label, length)
                            if args.deadline is not None and time.time() + expected > args.deadline:
                                logger.info("%s @%s, %d tokens, %s: not started (expected %.0f s, %.0f s left of "
                                            "--time-budget)", method, budget, length, task, expected,
                                            args.deadline - time.time())
                                continue
                            if args.part is not None and not second_pass and not claim(args.out, (*key, task)):
                                continue  # another worker has it
                            name = f"oasis_ruler_{task}_{length}"
                            started = time.perf_counter()
                            try:
                                if lm is None:
                                    if needs_draft:
                                        if draft is None:
                                            draft = models.load(preset["draft"], device=device)[0]
                                            preset["shapes"]["draft"] = kv_shape(draft)
                                            stretched.enter_context(yarn_context(draft, need))
                                        fields["draft_model"] = draft
                                    lm_class = PressLM if "press" in fields else OasisLM
                                    lm = lm_class(pretrained=model, tokenizer=tokenizer, budget=budget or 2048,
                                                  device=device, batch_size=batch_size,
                                                  graphs=preset["whole_step_graphs"], **fields)
                                out = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=manager,
                                                              apply_chat_template=args.chat_template)
                            except Exception as exc:  # noqa: BLE001 - recorded and reported; the others still run
                                logger.exception("%s @%s, %d tokens, %s raised", method, budget, length, task)
                                if isinstance(exc, torch.OutOfMemoryError) and not second_pass:
                                    retry.add((*key, task))  # a failure only if the second pass fails too
                                elif (*key, task) not in retry:
                                    failed.append(f"{label} @{budget or 'full'}, {length} tokens, {task}")
                                row = _row(rows, key, previous)
                                row.setdefault("errors", {})[task] = f"{type(exc).__name__}: {exc}"[:300]
                                report(args, preset, model, rows, lm_eval.__version__, final=False)
                                continue
                            finally:  # --parts workers share a GPU: what a task's batches reserved goes back to them
                                if device.startswith("cuda") and args.part is not None:
                                    torch.cuda.empty_cache()
                            seconds = time.perf_counter() - started
                            taken.setdefault((label, length), []).append(seconds)
                            row = _row(rows, key, previous)
                            row[task] = out["results"][name]["score,none"]
                            row.setdefault("seconds", {})[task] = round(seconds, 1)
                            row.setdefault("batch_size", {})[task] = batch_size
                            if row.get("errors", {}).pop(task, None) is not None and not row["errors"]:
                                del row["errors"]
                            retry.discard((*key, task))
                            complete_row(row)
                            logger.info("%s @%s, %d tokens, %s: %.1f in %.0f s%s", method, budget, length, task,
                                        row[task], seconds,
                                        f" (row average {row['average']:.1f})" if "average" in row else "")
                            report(args, preset, model, rows, lm_eval.__version__, final=False)
    report(args, preset, model, rows, lm_eval.__version__, final=True)
    failed += [f"{label} @{budget or 'full'}, {length} tokens, {task}" for label, budget, length, task in retry]
    if failed:
        raise SystemExit(f"{len(failed)} task(s) raised (their errors are under 'errors' in {args.out}, their "
                         f"tracebacks above; --resume runs them again): {failed}")


def expected_seconds(taken: dict, previous: dict, label: str, length: int) -> float:
    """How long a task of method `label` at `length` is expected to take: the longest one of its rows (any budget)
    has taken in this run (`taken`: (label, length) -> seconds), else the median of those recorded in --out (an
    earlier run, maybe on other hardware), else 0 (nothing known: it is started)."""
    if taken.get((label, length)):
        return max(taken[(label, length)])
    recorded = sorted(s for (method, _, size), row in previous.items() if method == label and size == length
                      for s in row.get("seconds", {}).values())
    return recorded[len(recorded) // 2] if recorded else 0.0


def _row(rows: list[dict], key: tuple, previous: dict) -> dict:
    """The row of `key` in `rows`, made (with the task scores --out already holds for it) on first use."""
    row = next((r for r in rows if row_key(r) == key), None)
    if row is None:
        label, budget, length = key
        row = {"method": label, "budget": budget, "length": length,
               **{t: v for t, v in previous.get(key, {}).items()
                  if t in TASKS or t in ("seconds", "batch_size")}}
        rows.append(row)
    return row


def cached_suite(tokenizer, model_name: str, lengths: list[int], samples: int) -> list[Path]:
    """The suite for (the model's tokenizer, `lengths`, `samples`) as one folder per length, each written once under
    the model cache (``<OASIS_HF_CACHE>/suites/<key>``) and reused by later runs, whatever other lengths they ask for,
    and by the ``--parts`` workers: generating it tokenizes every prompt (on a 2-core CPU, 63 s at 30k and 136 s at
    64k for the 9 tasks x 50 samples). The key covers the generator's source, so a changed generator writes a new
    suite; a file lock makes concurrent workers wait for the first writer, and a folder counts only once its
    ``complete`` mark is written. A folder copied from another machine or cache is pointed at its own data first
    (`relocate_suite`). Pass the list to lm-eval's ``TaskManager(include_path=...)``."""
    import hashlib
    import inspect

    from eval.tasks import ruler

    folders = []
    for length in sorted(set(lengths)):
        key = hashlib.sha256(json.dumps([model_name, length, samples, inspect.getsource(ruler)]).encode())
        folder = models.cache_dir() / "suites" / key.hexdigest()[:16]
        folder.mkdir(parents=True, exist_ok=True)
        with models.cache_lock(folder / ".lock"):
            if not (folder / "complete").is_file():
                logger.info("writing the suite (%d tokens, %d samples per task) to %s", length, samples, folder)
                write_suite(folder, tokenizer, [length], samples)
                (folder / "complete").write_text(f"{model_name} {length} {samples}\n")
            relocate_suite(folder)
        folders.append(folder)
    return folders


def part_path(out: Path, part: int) -> Path:
    return out.with_name(f"{out.name}.part{part}")


def claims_dir(out: Path) -> Path:
    """Where the workers of a ``--parts`` run claim rows (next to the worker's ``<out>.partK`` files)."""
    return out.parent / f"{re.sub(r'[.]part[0-9]+$', '', out.name)}.claims"


def claim(out: Path, key: tuple) -> bool:
    """Claim row `key` for this worker: True for exactly one of the workers that ask (exclusive file creation)."""
    folder = claims_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    name = "_".join(str(part) for part in key).replace("/", "-").replace(" ", "-")
    try:
        os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def worker_gpu(part: int, visible: str | None, gpus: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of worker `part` on a machine where the caller may use `gpus` GPUs: GPU
    ``part % gpus`` of those (its own ``CUDA_VISIBLE_DEVICES`` list where set, so ``CUDA_VISIBLE_DEVICES=4,5,6,7 ...
    --parts 4`` stays on 4-7, and ``--parts 4`` on two GPUs puts two workers on each)."""
    index = part % gpus
    return visible.split(",")[index].strip() if visible else str(index)


def run_parts(parser: argparse.ArgumentParser, args) -> None:
    """``--parts N``: start N workers of this command (worker K on GPU ``K % G`` of the G the caller may use; more
    workers than GPUs share them round-robin),
    wait for them, merge their rows with ``--out``'s (``--resume``) and write the report and plot there. Stopped by
    SIGTERM (``timeout``), it stops the workers and still merges the rows they finished; the worker files are deleted
    once merged. Worker files that an earlier run left unmerged (it was killed before its merge) are merged into
    ``--out`` first, never deleted unread."""
    if args.out is None:
        parser.error("--parts needs --out (the workers write next to it, the merged result goes there)")
    if args.parts < 1:
        parser.error(f"--parts {args.parts}: give a positive number of workers")
    preset = preset_of(args)
    leftovers = part_files(args.out)
    if leftovers:  # an earlier run's workers finished these tasks; its merge never ran
        logger.info("merging %d worker files left by an earlier run into %s", len(leftovers), args.out)
        merge_parts(args, preset, leftovers, resume=True, parts=None)
        args.resume = True  # --out holds them now: the final merge keeps them (workers always resume from --out)
    gpus = torch.cuda.device_count()
    if 0 < gpus < args.parts:  # e.g. two workers per GPU for rows that leave a GPU partly idle (batch 1)
        logger.info("--parts %d on %d GPUs: %s workers per GPU", args.parts, gpus,
                    "/".join(str(len(range(g, args.parts, gpus))) for g in range(gpus)))
    clear_worker_files(args.out)  # a fresh start: their rows are in --out now
    argv = worker_argv(sys.argv[1:])
    workers = []
    for part in range(args.parts):
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = worker_gpu(part, os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        # One deadline for all workers (--time-budget counted from the parent's start), not a budget each.
        deadline = [] if args.deadline is None else ["--deadline", repr(args.deadline)]
        cmd = [sys.executable, "-m", "eval.accuracy", *argv, *deadline, "--part", str(part), "--resume"]
        workers.append(subprocess.Popen(cmd, env=env))
    # `timeout` signals its child and then the whole process group (the workers too): the first SIGTERM stops the
    # waiting below, later ones are ignored so that the merge runs to its end.
    previous, stopped = signal.signal(signal.SIGTERM, _stop), False
    try:
        failed = [part for part, worker in enumerate(workers) if worker.wait() != 0]
    except _Stopped:
        stopped = True
        for worker in workers:
            if worker.poll() is None:
                worker.terminate()
        failed = [part for part, worker in enumerate(workers) if worker.wait() != 0]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the merge runs to its end
    try:
        rows = merge_parts(args, preset, part_files(args.out), resume=args.resume, parts=args.parts)
        clear_worker_files(args.out)  # merged: a later run must not merge them again as an earlier run's leftovers
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        raise SystemExit(f"stopped by SIGTERM: the {len(rows)} finished rows are merged into {args.out}; run again "
                         "with --resume for the rest")
    if failed:
        raise SystemExit(f"workers {failed} of --parts {args.parts} failed: tasks that raised are listed under "
                         f"'errors' in {args.out}, a worker that died left its claimed task undone; see their logs "
                         "above, then run again with --resume")


def part_files(out: Path) -> list[Path]:
    """The worker files (``<out>.partK.json``) next to `out`, in part order."""
    return sorted(out.parent.glob(f"{out.name}.part*.json"), key=lambda p: int(p.name.split(".part")[-1][:-5]))


def clear_worker_files(out: Path) -> None:
    """Delete the claims and ``<out>.partK`` files of earlier workers (only once their rows are merged into `out`)."""
    for stale in [*claims_dir(out).glob("*"), *out.parent.glob(f"{out.name}.part*")]:
        stale.unlink()


class _Stopped(Exception):
    """SIGTERM reached a ``--parts`` parent (a time limit): stop the workers, keep their finished rows."""


def _stop(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop: the cleanup and merge must not be interrupted again
    raise _Stopped


def worker_argv(argv: list[str]) -> list[str]:
    """The parent's arguments without ``--parts N`` / ``--parts=N``: what each worker runs (plus ``--part K``)."""
    return without_option(without_option(argv, "--parts"), "--time-budget")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
