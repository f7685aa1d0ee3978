"""eval.bench_e2e's row bookkeeping on the CPU (the benchmark itself needs the real models and a GPU)."""

import torch
import torch._dynamo

from eval.bench_e2e import run_row


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row.tolist())) for row in ids]


def _row(fn):
    inputs = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    return run_row("method", fn, inputs, _Tokenizer(), keys=["1", "9"], new_tokens=2)


def test_a_row_that_compiles_during_its_timed_call_is_marked_invalid():
    """A timed call that runs torch.compile (a warm-up that missed a shape) measures a compilation, not the method:
    its row says so, and one that only reuses what was compiled does not."""

    def step(x):
        return x * 2 + 1

    compiled = torch.compile(step, dynamic=False)

    def generate(width):
        def fn():
            new = compiled(torch.ones(2, width, dtype=torch.long))[:, :2]
            return torch.cat([torch.zeros(2, 3, dtype=torch.long), new], dim=1), None, None
        return fn

    try:
        first = _row(generate(4))
        again = _row(generate(4))
        other = _row(generate(5))
    finally:
        torch._dynamo.reset()
    assert "compilation" in first["invalid"] and "invalid" not in again and "compilation" in other["invalid"]
    assert again["pass keys found"] == "0/2" and again["new tokens/s"] > 0


def test_a_failing_row_records_its_error_and_no_figures():
    def fn():
        raise RuntimeError("out of memory")

    row = _row(fn)
    assert row["error"] == "RuntimeError: out of memory" and "seconds" not in row


def test_the_draft_model_is_loaded_only_for_rows_that_run_it():
    """A run of the target-only rows (greedy, dense graphed, model.generate over OasisCache) needs no draft weights,
    so it loads (and needs on disk) the target alone."""
    from eval.bench_e2e import KINDS, uses_draft

    assert uses_draft(None)
    assert not uses_draft(["generate-oasis", "dense-graphed", "generate-oasis-compiled", "dense-graphed-compiled"])
    assert all(uses_draft(["greedy", kind]) for kind in KINDS if kind.startswith(("speculative", "assisted")))


def test_step_split_separates_the_first_steps_from_the_steady_ones():
    from eval.bench_e2e import FIRST_STEPS, step_split

    # first token at 0; the first FIRST_STEPS steps take 1 s each (eager, capture), the later ones 10 ms
    stamps = [float(i) for i in range(FIRST_STEPS + 1)] + [FIRST_STEPS + 0.01 * i for i in range(1, 8)]
    split = step_split(stamps)
    assert split["first steps s"] == FIRST_STEPS
    assert split["first steps ms"] == " / ".join(["1000.0"] * FIRST_STEPS)
    assert abs(split["steady ms/step"] - 10.0) < 1e-6
    assert step_split(stamps[: FIRST_STEPS + 2]) == {}  # too few steps to say


def test_a_generate_row_reports_its_step_split():
    from eval.bench_e2e import FIRST_STEPS, StepClock

    def fn():
        clock = StepClock()
        for _ in range(FIRST_STEPS + 4):
            clock(torch.zeros(2, 1, dtype=torch.long), None)
        return torch.zeros(2, 5, dtype=torch.long), None, clock

    row = _row(fn)
    assert row["TTFT s"] >= 0 and row["first steps s"] >= 0 and row["steady ms/step"] >= 0


def test_isolate_runs_each_kind_in_a_child_and_keeps_one_baseline(monkeypatch):
    """--isolate: one child process per kind of a batch, each asked for that batch and kind alone; the table keeps
    the first child's baseline row and every child's other rows, in the order of the kinds."""
    import argparse

    import eval.bench_e2e as bench

    calls = []

    def fake_child_rows(module, argv, tmp, extra):
        calls.append((module, list(argv), extra))
        kind, pid = extra[extra.index("--kinds") + 1], len(calls)
        return [{"method": "greedy, DynamicCache", "pid": pid}, {"method": f"row of {kind}", "pid": pid}]

    monkeypatch.setattr(bench, "child_rows", fake_child_rows)
    args = argparse.Namespace(kinds=["generate-oasis", "dense-graphed"])
    rows = bench.isolated_rows(args, 8, ["--isolate", "--batches", "1", "8"])
    assert [r["method"] for r in rows] == ["greedy, DynamicCache", "row of generate-oasis", "row of dense-graphed"]
    assert [r["pid"] for r in rows] == [1, 1, 2]
    assert [c[2] for c in calls] == [["--batches", "8", "--kinds", kind, bench.ISOLATED_FLAG]
                                     for kind in args.kinds]
    assert all(c[0] == "eval.bench_e2e" and c[1] == ["--isolate", "--batches", "1", "8"] for c in calls)
    bench.isolated_rows(argparse.Namespace(kinds=None), 1, [])  # no --kinds: every kind
    assert len(calls) == 2 + len(bench.KINDS)


def test_finished_rows_record_their_process_and_dtype():
    import os

    from eval.bench_e2e import finished

    base = {"method": "greedy", "new tokens/s": 10.0, "tokens": torch.zeros(1, 2)}
    other = {"method": "x", "new tokens/s": 20.0, "tokens": torch.zeros(1, 2)}
    rows = finished([base, other], torch.bfloat16)
    assert [r["pid"] for r in rows] == [os.getpid()] * 2 and {r["dtype"] for r in rows} == {"bfloat16"}
    assert rows[1]["vs greedy DynamicCache"] == 2.0 and "tokens" not in rows[1]


def test_timed_calls_keep_the_median_call_and_the_spread():
    from eval.bench_e2e import median_call

    calls = [{"method": "m", "seconds": s, "new tokens/s": 100 / s} for s in (2.0, 1.0, 4.0)]
    row = median_call(calls)
    assert row["seconds"] == 2.0 and row["timed calls"] == 3
    assert row["new tokens/s (min, max)"] == "25, 100"
    assert median_call(calls[:1]) == calls[0]  # one call: the row as it was, no spread columns
    failed = {"method": "m", "error": "RuntimeError: x"}
    assert median_call([calls[0], failed]) is failed
