"""End-to-end generation speed on a real model pair: our batched draft-and-verify loop on OasisCache against plain
greedy decoding, at batch 1 and batch B, on long retrieval prompts.

    python -m eval.bench_e2e --model qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \
        --context 16000 --batches 1 8 --new-tokens 128 --budget 2048 --out eval/results/e2e_qwen_16k

Every row generates `--new-tokens` greedy tokens for the same left-padded batch of pass-key prompts (one pass key per
sequence, `oasis_hf.cli.passkey_prompt` with a seed per sequence):

- ``greedy, DynamicCache``: ``model.generate`` (the baseline a user has);
- ``dense graphed``: the strongest dense decode (`eval.dense_baselines.dense_graphed_generate`): the prefill, then
  every step one CUDA graph replay over preallocated K/V;
- ``model.generate, OasisCache lookahead``: what a user of ``oasis_hf.enable(model)`` runs, each decode forward a
  replay of the whole-step graph;
- the same two with the model through ``torch.compile`` inside the captured graph (``dense-graphed-compiled``,
  ``generate-oasis-compiled``: `OasisConfig.compile_model`); the warm-up compiles, the timed call reuses what
  ``torch.compile`` cached for the model;
- ``decode_generate, OasisCache lookahead`` (``decode-oasis``, ``decode-oasis-compiled``): the same cache through
  `oasis_hf.decode_generate`, a bare loop of whole-step graph replays that, like dense graphed's, never waits for a
  step: against the ``model.generate`` rows it shows what transformers' loop costs;
- ``greedy, OasisCache current-query``: the same with OasisKV, and through whole-model CUDA graphs
  (`oasis_hf.decode_generate`: the same tokens, one launch per step);
- ``HF assisted, DynamicCache`` (batch 1 only: transformers refuses larger batches);
- ``speculative_generate, DynamicCache`` and ``speculative_generate, OasisCache lookahead``: our loop
  (`oasis_hf.speculative_generate`), whose greedy output equals the target's greedy output; its draft steps are
  CUDA graph replays (`oasis_hf.draft.GraphedDraft`), one more row runs them eagerly to show what that buys, and
  one runs the target's verify forwards as whole-model graphs too (`oasis_hf.DecodeGraph`, ``target_graphs``).

OasisKV rows take their pinned host store from one `oasis_hf.PinnedPool` shared by the run (``--host-pool shared``,
the default: what lm-eval's ``oasis`` model and a server do; the warm-up pins it), as dense graphed's buffers come
from PyTorch's caching allocator; ``--host-pool none`` page-locks it in every call (up to a few tenths of a second
at 16k that the prefill cannot hide).

``--timed-calls N`` times N calls per row (after the one warm-up); the row is the call of median seconds, with the
slowest and fastest call's tokens/s beside it.

``--reuse`` keeps each row's state from its warm-up call to its timed call, as a server keeps it from one request to
the next: the OasisKV rows run over one `OasisCache` per row, reset in between (`oasis_hf.CacheSlot`: its buffers,
host store and captured graphs stay), and dense graphed keeps its K/V buffers and captured step
(`eval.dense_baselines.DenseGraphedSession`). Then neither pays an eager step or a graph capture in the timed call.

Reported per row: seconds (prefill included), new tokens/s over the batch, the time to the first token and the
decode tokens/s after it (rows through ``model.generate`` and dense graphed); for ``model.generate`` rows also the
seconds of the first decode steps (eager steps and graph captures: what each call pays once) and the median step
after them (`StepClock`, `step_split`), the ratio to greedy DynamicCache at the
same batch, draft acceptance, whether the output equals greedy DynamicCache's, and how many pass keys came out.
The draft model is loaded only when a requested row runs it (``--kinds`` without the assisted and speculative rows
needs the target's weights alone).

``--isolate`` runs every kind of every batch in a process of its own (this script with the same arguments, that
batch and that kind; each child runs the greedy baseline too, and its rows' ratios are against its own baseline),
so that no row depends on which rows ran before it in a process (compilation caches, the allocator, the pinned
pool); the table keeps the first child's baseline row per batch, and every row records its ``pid``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

import oasis_hf
from eval._common import (
    child_rows,
    code_identity,
    environment,
    finish,
    markdown_table,
    median,
    synchronize,
    write_results,
)
from eval.dense_baselines import DenseGraphedSession, dense_graphed_generate
from eval.plot import plot_e2e
from oasis_hf import compat, models
from oasis_hf.cli import passkey_prompt

logger = logging.getLogger("eval.bench_e2e")


def batch_prompts(tokenizer, context: int, batch: int, device) -> tuple[dict, list[str]]:
    prompts, keys = zip(*(passkey_prompt(context, tokenizer, seed=i) for i in range(batch)), strict=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer(list(prompts), return_tensors="pt", padding=True).to(device), list(keys)


#: The flag of an ``--isolate`` run's children (`isolated_rows`); hidden from --help.
ISOLATED_FLAG = "--isolated-child"
HOST_POOL = {"shared": "one PinnedPool shared by the run", "none": "a buffer page-locked afresh in every call"}
KINDS = ["greedy", "greedy-graphs", "generate-oasis", "dense-graphed", "generate-oasis-compiled",
         "dense-graphed-compiled", "decode-oasis", "decode-oasis-compiled", "assisted", "speculative",
         "speculative-target-graphs", "speculative-eager-draft"]
DRAFT_KINDS = ("assisted", "speculative", "speculative-target-graphs", "speculative-eager-draft")  # need --draft


def uses_draft(kinds: list[str] | None) -> bool:
    """Whether a run of `kinds` (None: all) has a row that runs the draft model; the others need the target alone."""
    return kinds is None or any(kind in DRAFT_KINDS for kind in kinds)


class StepClock(StoppingCriteria):
    """Never stops; stamps the time of every call (once per step). The first call waits for the device (the first
    token: time to first token); later ones stamp without waiting, so that the clock adds no synchronisation to
    the loop it times: transformers' loop waits for every step itself, the queued loop
    (`oasis_hf.integrations.queued_generate`) stays at most one step ahead of the device, so in steady state the
    intervals between stamps are the device's steps. They split the decode phase into its first steps (eager steps
    and graph captures) and the steady steps after them."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    @property
    def first(self) -> float | None:
        return self.stamps[0] if self.stamps else None

    def __call__(self, input_ids, scores, **kwargs):
        if not self.stamps:
            synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


#: Decode steps counted as the first (warm-up) steps of a call in `step_split`: up to two eager steps, the capture.
FIRST_STEPS = 4


def step_split(stamps: list[float]) -> dict:
    """``{"first steps s", "first steps ms", "steady ms/step"}`` of one call's `StepClock` stamps: the seconds from
    the first token to the end of the first `FIRST_STEPS` decode steps, each of those steps in milliseconds (which
    were eager steps or captures shows as their size), and the median step after them (empty when too few)."""
    if len(stamps) <= FIRST_STEPS + 2:
        return {}
    steady = [b - a for a, b in zip(stamps[FIRST_STEPS:], stamps[FIRST_STEPS + 1 :], strict=False)]
    first = [round(1e3 * (b - a), 1) for a, b in zip(stamps[:FIRST_STEPS], stamps[1 : FIRST_STEPS + 1], strict=True)]
    return {"first steps s": stamps[FIRST_STEPS] - stamps[0], "first steps ms": " / ".join(map(str, first)),
            "steady ms/step": 1e3 * median(steady)}


@torch.inference_mode()
def run_row(label: str, fn, inputs, tokenizer, keys, new_tokens: int) -> dict:
    gc.collect()  # the previous row's cache goes now, not at a random point of this one
    synchronize()
    compiled_before = counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    try:
        sequences, stats, clock = fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the table: one failing method must not lose the others
        logger.exception("%s failed", label)
        return {"method": label, "batch": inputs["input_ids"].shape[0], "error": f"{type(exc).__name__}: {exc}"[:200]}
    synchronize()
    seconds = time.perf_counter() - t0
    first = clock if clock is None or isinstance(clock, float) else clock.first
    new = sequences[:, inputs["input_ids"].shape[1] :]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    batch = new.shape[0]
    row = {"method": label, "batch": batch, "seconds": seconds, "new tokens/s": batch * new_tokens / seconds,
           "TTFT s": None if first is None else first - t0,
           "decode tokens/s": None if first is None else batch * (new_tokens - 1) / max(1e-9, seconds - (first - t0)),
           "pass keys found": f"{sum(k in t for k, t in zip(keys, texts, strict=True))}/{batch}",
           "tokens": new[:, :new_tokens].cpu()}
    if isinstance(clock, StepClock):
        row.update(step_split(clock.stamps))
    if counters["stats"]["unique_graphs"] != compiled_before:  # the warm-up should have compiled everything
        row["invalid"] = "torch.compile compiled during the timed call: these seconds include a compilation"
        logger.error("%s, batch %d: %s", label, batch, row["invalid"])
    if stats is not None:
        row["draft acceptance"] = stats.acceptance
        row["drafts per round"] = stats.drafted / max(1, stats.rounds)
        rounds = max(1, stats.rounds)
        row["draft ms/round"] = 1e3 * stats.draft_seconds / rounds
        row["verify ms/round"] = 1e3 * stats.verify_seconds / rounds
        row["accept + crop ms/round"] = 1e3 * stats.accept_seconds / rounds
    logger.info("%s, batch %d: %.2f s", label, batch, seconds)
    return row


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--context", type=int, default=16000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--timed-calls", type=int, default=1,
                        help="timed calls per row: the row is the call of median seconds, with the spread of all "
                             "(tokens/s min and max)")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--drafts", type=int, default=4,
                        help="draft tokens per round of speculative_generate (the most, with the adaptive schedule)")
    parser.add_argument("--draft-schedule", choices=["adaptive", "constant"], default="adaptive",
                        help="speculative_generate's draft_schedule (its default with a draft model: adaptive)")
    parser.add_argument("--kinds", nargs="+", default=None, choices=KINDS,
                        help="rows to run besides the greedy DynamicCache baseline (default: all)")
    parser.add_argument("--host-pool", choices=["shared", "none"], default="shared",
                        help="shared: every OasisCache takes its pinned host store from one PinnedPool (as lm-eval's "
                             "model and a server reuse it; the warm-up pins it), none: each call page-locks afresh")
    parser.add_argument("--reuse", action="store_true",
                        help="keep each row's state from its warm-up call to its timed call, as a server keeps it "
                             "from request to request: OasisKV rows run over one OasisCache per row, reset in between "
                             "(oasis_hf.CacheSlot: buffers, host store and captured graphs kept), dense graphed keeps "
                             "its K/V buffers and captured step (DenseGraphedSession); default: every call fresh")
    parser.add_argument("--isolate", action="store_true",
                        help="run every kind of every batch in a process of its own (with its own greedy baseline)")
    parser.add_argument(ISOLATED_FLAG, action="store_true", help=argparse.SUPPRESS)  # isolated_rows' children
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.isolate and not args.isolated_child:
        rows: list[dict] = []
        for batch in args.batches:
            rows += isolated_rows(args, batch, sys.argv[1:])
            report(args, rows, final=False)  # a cut-short run keeps the batches it finished
        report(args, rows, final=True)
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = models.load(args.model, device=device)
    dtype = model.dtype
    draft = models.load(args.draft, device=device, dtype=model.dtype)[0] if uses_draft(args.kinds) else None
    oasis_hf.enable(model)  # dense caches still get dense attention: only OasisCache layers take the oasis path
    n = args.new_tokens
    pool = oasis_hf.PinnedPool() if args.host_pool == "shared" else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def cfg(selector, kind=""):
        return oasis_hf.OasisConfig(budget_tokens=args.budget, selector=selector,
                                    compile_model=kind.endswith("-compiled"))

    slots: dict[tuple, oasis_hf.CacheSlot] = {}  # --reuse: per (kind, selector)
    sessions: dict[str, DenseGraphedSession] = {}  # --reuse: per dense graphed kind

    def open_cache(kind: str, selector: str):
        """The row's OasisCache for one call: with --reuse the row's slot's (reset afterwards), else a new one
        (closed afterwards)."""
        if not args.reuse:
            return oasis_hf.OasisCache(model.config, cfg(selector, kind), host_pool=pool)
        if (kind, selector) not in slots:
            slots[kind, selector] = oasis_hf.CacheSlot(model.config, cfg(selector, kind), host_pool=pool)
        return slots[kind, selector].cache()

    inputs, gen = None, None  # set per batch below

    def generate(kind: str, cache):
        """(sequences, SpeculativeStats or None, time of the first token or None) of one row; `cache` None means
        DynamicCache."""
        if kind.startswith("speculative"):
            out = oasis_hf.speculative_generate(model, draft, inputs["input_ids"], inputs["attention_mask"],
                                                cache=cache, max_new_tokens=gen["max_new_tokens"],
                                                num_draft_tokens=args.drafts, pad_token_id=pad,
                                                draft_schedule=args.draft_schedule,
                                                draft_cuda_graphs=kind != "speculative-eager-draft",
                                                target_graphs=kind == "speculative-target-graphs")
            return out.sequences, out.stats, None
        if kind.startswith("decode-oasis") or kind == "greedy-graphs":
            out = oasis_hf.decode_generate(model, inputs["input_ids"], inputs["attention_mask"], cache=cache,
                                           max_new_tokens=gen["max_new_tokens"], pad_token_id=pad)
            return out, None, None
        if kind in ("dense-graphed", "dense-graphed-compiled"):
            t0 = time.perf_counter()
            # The timed row's capacity in the warm-up too: the compiled row then reuses the warm-up's compilation.
            out, ttft = dense_graphed_generate(model, inputs["input_ids"], inputs["attention_mask"],
                                               gen["max_new_tokens"], compiled=kind == "dense-graphed-compiled",
                                               capacity=inputs["input_ids"].shape[1] + n,
                                               session=sessions.setdefault(kind, DenseGraphedSession())
                                               if args.reuse else None)
            return out, None, t0 + ttft
        extra = {"assistant_model": draft} if kind == "assisted" else {}
        cache = cache if cache is not None else DynamicCache(config=model.config)
        clock = StepClock()
        out = model.generate(**inputs, **gen, **extra, **{compat.cache_kwarg(model): cache},
                             stopping_criteria=StoppingCriteriaList([clock]))
        return out, None, clock

    def warm_up() -> None:
        """A short run of each path at the timed batch and context, outside the timed rows: CUDA context, cuBLAS,
        Triton compilation (some kernels compile one variant per shape class: `plan_blocks`, 3-7 s each) and the
        allocator's growth, so that no row pays them for the rows after it."""
        nonlocal gen
        gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=pad)
        with torch.inference_mode():
            generate("greedy", None)
            for kind, selector in (("dense-graphed", None), ("dense-graphed-compiled", None),
                                   ("greedy", "current-query"), ("greedy-graphs", "current-query"),
                                   ("generate-oasis", "lookahead"), ("generate-oasis-compiled", "lookahead"),
                                   ("decode-oasis", "lookahead"), ("decode-oasis-compiled", "lookahead"),
                                   ("speculative", None), ("speculative", "lookahead"),
                                   ("speculative-target-graphs", "lookahead")):
                if args.kinds is not None and kind not in args.kinds:
                    continue
                if selector is None:
                    generate(kind, None)
                    continue
                try:  # a path that fails here fails again in its timed row, which records the error
                    with open_cache(kind, selector) as cache:
                        # Sized for the timed call's tokens: the pinned buffer this returns to the pool is the one
                        # the timed row takes, not one page-locked anew during its prefill.
                        cache.plan_tokens(inputs["input_ids"].shape[1] + n)
                        generate(kind, cache)
                except Exception as exc:  # noqa: BLE001
                    logger.error("warm-up of %s failed: %r", kind, exc)

    rows = []
    for batch in args.batches:
        inputs, keys = batch_prompts(tokenizer, args.context, batch, device)
        warm_up()
        gen = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        variants = [("greedy, DynamicCache", "greedy", None),
                    ("dense graphed (prefill, then one CUDA graph replay per step)", "dense-graphed", None),
                    (f"model.generate, OasisCache lookahead @{args.budget} (whole-step graph via oasis_hf.enable)",
                     "generate-oasis", "lookahead"),
                    ("dense graphed, model through torch.compile", "dense-graphed-compiled", None),
                    (f"model.generate, OasisCache lookahead @{args.budget}, compile_model (whole-step graph of the "
                     "compiled model)", "generate-oasis-compiled", "lookahead"),
                    (f"decode_generate, OasisCache lookahead @{args.budget} (whole-step graph replays, no per-step "
                     "sync)", "decode-oasis", "lookahead"),
                    (f"decode_generate, OasisCache lookahead @{args.budget}, compile_model", "decode-oasis-compiled",
                     "lookahead"),
                    (f"greedy, OasisCache current-query @{args.budget}", "greedy", "current-query"),
                    (f"greedy, OasisCache current-query @{args.budget}, whole-step graphs (decode_generate)",
                     "greedy-graphs", "current-query")]
        if batch == 1:
            variants.append(("HF assisted (draft), DynamicCache", "assisted", None))
        variants += [("speculative_generate, DynamicCache", "speculative", None),
                     (f"speculative_generate, OasisCache lookahead @{args.budget}", "speculative", "lookahead"),
                     (f"speculative_generate, OasisCache lookahead @{args.budget}, whole-step target graphs",
                      "speculative-target-graphs", "lookahead"),
                     (f"speculative_generate, OasisCache lookahead @{args.budget}, draft eager (no CUDA graph)",
                      "speculative-eager-draft", "lookahead")]
        if args.kinds is not None:
            variants = variants[:1] + [v for v in variants[1:] if v[1] in args.kinds]
        batch_rows = []
        for label, kind, selector in variants:
            calls = []
            for _ in range(args.timed_calls):
                with open_cache(kind, selector) if selector else contextlib.nullcontext() as cache:
                    calls.append(run_row(label, lambda: generate(kind, cache), inputs, tokenizer, keys, n))  # noqa: B023
                cache = None  # collected before the next call starts timing (run_row collects)
            batch_rows.append(median_call(calls))
            report(args, rows + finished(batch_rows, dtype), final=False)  # a cut-short run keeps its rows
        for slot in slots.values():
            slot.close()
        slots.clear()
        sessions.clear()
        rows += finished(batch_rows, dtype)
    report(args, rows, final=True)


def median_call(calls: list[dict]) -> dict:
    """One row of `calls` (the timed calls of a row): the first failed one, or the call of median seconds with the
    number of calls and the slowest and fastest call's tokens/s beside it."""
    failed = [call for call in calls if "error" in call]
    if failed:
        return failed[0]
    row = dict(sorted(calls, key=lambda call: call["seconds"])[(len(calls) - 1) // 2])
    if len(calls) > 1:
        rates = [call["new tokens/s"] for call in calls]
        row.update({"timed calls": len(calls), "new tokens/s (min, max)": f"{min(rates):.4g}, {max(rates):.4g}"})
    return row


def isolated_rows(args, batch: int, argv: list[str]) -> list[dict]:
    """The rows of one batch size with every requested kind (default: all) in a child process of its own
    (``--isolate``): the first child's baseline row, then each child's other rows (their ratios against their own
    process's baseline)."""
    rows: list[dict] = []
    for kind in args.kinds or KINDS:
        with tempfile.TemporaryDirectory() as tmp:
            child = child_rows("eval.bench_e2e", argv, Path(tmp),
                               ["--batches", str(batch), "--kinds", kind, ISOLATED_FLAG])
        rows += child if not rows else child[1:]  # the baseline comes first in every child
    return rows


def finished(batch_rows: list[dict], dtype: torch.dtype | None = None) -> list[dict]:
    """The rows of one batch size with their ratios to the first (greedy DynamicCache) row, tokens dropped, and the
    process and the target's dtype they ran with."""
    base = batch_rows[0]
    out = []
    for row in batch_rows:
        row = dict(row, pid=os.getpid(), dtype=str(dtype).removeprefix("torch.") if dtype is not None else None)
        if "error" not in row and "error" not in base:
            row["vs greedy DynamicCache"] = row["new tokens/s"] / base["new tokens/s"]
            row["same tokens as greedy DynamicCache"] = bool(torch.equal(row["tokens"], base["tokens"]))
        row.pop("tokens", None)
        out.append(row)
    return out


def report(args, rows: list[dict], final: bool) -> None:
    env = environment()
    draft = f"draft {args.draft}" if uses_draft(args.kinds) else "no draft (no row of this run uses one)"
    dtypes = sorted({str(r["dtype"]) for r in rows if r.get("dtype")})
    isolated = "; every kind in a process of its own (--isolate)" if args.isolate else ""
    isolated += ("; each row's cache, buffers and captured graphs kept from its warm-up to its timed call (--reuse)"
                 if args.reuse else "; every call with a new cache and new graphs")
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']};"
              f" target {args.model} ({', '.join(dtypes) or '?'}){isolated}, "
              f"{draft}; pass-key prompts of about "
              f"{args.context} tokens, {args.new_tokens} greedy tokens per sequence, at most {args.drafts} drafts per "
              f"round ({args.draft_schedule} schedule); "
              f"budget {args.budget}; OasisKV host store from {HOST_POOL[args.host_pool]}; `{env['command']}`\n\n")
    columns = ["method", "batch", "seconds", "new tokens/s", "TTFT s", "decode tokens/s", "first steps s",
               "first steps ms", "steady ms/step", "vs greedy DynamicCache",
               "draft acceptance",
               "drafts per round", "draft ms/round", "verify ms/round", "accept + crop ms/round",
               "same tokens as greedy DynamicCache", "pass keys found"]
    columns += [c for c in ("timed calls", "new tokens/s (min, max)", "invalid", "error") if any(c in r for r in rows)]
    table = header + markdown_table(rows, columns)
    if final:
        finish(args, table, {"env": env, "rows": rows}, plot_e2e)
    elif args.out is not None:
        write_results(args.out, {"env": env, "config": vars(args) | {"out": str(args.out)}, "rows": rows}, table)


if __name__ == "__main__":
    main()
