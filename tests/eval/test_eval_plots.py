"""The benchmark figures draw from committed results (plumbing: files are written, skipped points tolerated)."""

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install -e .[dev] installs it)")

from eval import plot  # noqa: E402
from eval.bench_sweep import plot_sweep  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "eval" / "results"


def test_sweep_figures_from_committed_results(tmp_path):
    payload = json.loads((RESULTS / "multigpu_8b_2gpu.json").read_text())
    payload["rows"].append({"method": "dense DynamicCache (sdpa)", "context": 262144, "batch": 64,
                            "skipped": "does not fit"})  # a skipped point has no timings
    made = plot_sweep(payload, tmp_path / "sweep")
    assert [p.name for p in made] == ["sweep_step_vs_context.png", "sweep_throughput_vs_batch.png",
                                      "sweep_gpu_kv_vs_context.png"]
    assert all(p.stat().st_size > 10_000 for p in made)


@pytest.mark.parametrize("name", ["multigpu_8b_2gpu", "capacity_24g_32k", "kernels_h200", "remote_8b_32k",
                                  "lookahead_decode_8b_b8_32k", "accuracy_cpu_smollm2_2k", "recall_smollm2_2k",
                                  "floor_compiled_b1_b16_h200"])
def test_eval_plot_redraws_each_kind_of_result(tmp_path, name, capsys):
    copy = tmp_path / f"{name}.json"
    copy.write_text((RESULTS / f"{name}.json").read_text())
    plot.main([str(copy)])
    assert copy.with_suffix(".png").stat().st_size > 10_000, capsys.readouterr().out


def test_eval_plot_redraws_e2e_rows_and_skips_failed_ones(tmp_path):
    rows = [{"method": "greedy, DynamicCache", "batch": 1, "new tokens/s": 40.0},
            {"method": "speculative_generate, OasisCache lookahead @2048", "batch": 1, "new tokens/s": 55.0},
            {"method": "greedy, DynamicCache", "batch": 8, "new tokens/s": 250.0},
            {"method": "speculative_generate, OasisCache lookahead @2048", "batch": 8, "error": "RuntimeError: x"}]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"rows": rows}))
    plot.main([str(path)])
    assert path.with_suffix(".png").stat().st_size > 10_000


def test_accuracy_summary_and_resume_guard(tmp_path):
    """Rows per (method, budget, length) average over the lengths measured; --resume refuses another model."""
    from argparse import Namespace

    from eval._accuracy_results import load_previous, summarize

    rows = [{"method": "dense", "budget": "full", "length": 8192, "average": 80.0},
            {"method": "dense", "budget": "full", "length": 16384, "average": 60.0},
            {"method": "static (StreamingLLM)", "budget": 512, "length": 8192, "average": 20.0}]
    summary = summarize(rows)
    assert summary[0] == {"method": "dense", "budget": "full", "average": 70.0, "lengths": "8192 16384",
                          "@8192": 80.0, "@16384": 60.0}
    assert summary[1]["average"] == 20.0 and summary[1]["lengths"] == "8192"
    out = tmp_path / "acc"
    preset = {"model": "m", "draft": None, "samples": 50}
    out.with_suffix(".json").write_text(json.dumps({"config": preset, "rows": rows}))
    assert load_previous(Namespace(out=out), preset) == rows
    with pytest.raises(SystemExit, match="samples=50"):
        load_previous(Namespace(out=out), dict(preset, samples=10))


def test_accuracy_parts_claim_each_row_once_and_merge(tmp_path):
    """--parts plumbing: a row is claimed by exactly one worker, workers' rows merge one per key, the worker command
    drops --parts, and a dotted --out keeps its name (accuracy_qwen_1.5b -> accuracy_qwen_1.5b.json)."""
    from eval._accuracy_results import complete_row, merge_rows, summarize
    from eval.accuracy import claim, claims_dir, part_path, worker_argv, worker_gpu
    from eval.plot import result_path
    from eval.tasks import TASKS

    out = tmp_path / "accuracy_qwen_1.5b"
    key = ("kvpress SnapKV (query-aware)", 512, 8192, "vt")
    assert claim(part_path(out, 0), key) and not claim(part_path(out, 1), key) and not claim(out, key)
    assert claim(part_path(out, 1), ("dense", "full", 8192))
    assert claims_dir(part_path(out, 3)) == claims_dir(out) == tmp_path / "accuracy_qwen_1.5b.claims"
    a = [{"method": "dense", "budget": "full", "length": 8192, "average": 1.0}]  # written without its tasks
    b = [{"method": "dense", "budget": "full", "length": 8192, "average": 2.0},
         {"method": "dense", "budget": "full", "length": 16384, "average": 3.0}]
    assert [r["average"] for r in merge_rows(a, b)] == [1.0, 3.0]
    # Workers finish different tasks of one row: the merge unites them; the average appears with the last task.
    names = list(TASKS)
    first = [{"method": "dense", "budget": "full", "length": 8192, **{t: 10.0 for t in names[:4]}}]
    second = [{"method": "dense", "budget": "full", "length": 8192, **{t: 40.0 for t in names[3:-1]},
               "seconds": {t: 2.0 for t in names[3:-1]}, "batch_size": {t: 4 for t in names[3:-1]}}]
    partial = merge_rows(first, second)
    assert len(partial) == 1 and "average" not in partial[0] and partial[0][names[3]] == 10.0
    # A task's wall time and batch size travel with the score that was kept (none for the first row's tasks).
    assert partial[0]["seconds"] == {t: 2.0 for t in names[4:-1]}
    assert partial[0]["batch_size"] == {t: 4 for t in names[4:-1]}
    assert summarize(partial) == []  # a row missing a task is not averaged
    done = merge_rows(partial, [{"method": "dense", "budget": "full", "length": 8192, names[-1]: 100.0}])
    assert done[0]["average"] == pytest.approx((4 * 10.0 + 4 * 40.0 + 100.0) / len(names))
    assert complete_row({"method": "dense", names[0]: 1.0}) == {"method": "dense", names[0]: 1.0}
    assert [worker_gpu(k, "4,5, 6", 3) for k in range(3)] == ["4", "5", "6"]
    assert worker_gpu(1, None, 2) == worker_gpu(1, "", 2) == "1"
    assert [worker_gpu(k, None, 2) for k in range(4)] == ["0", "1", "0", "1"]  # --parts 4 on two GPUs
    assert [worker_gpu(k, "6,7", 2) for k in range(3)] == ["6", "7", "6"]
    assert worker_argv(["--preset", "gpu-qwen-1.5b", "--parts", "8", "--out", "x", "--parts=2"]) == [
        "--preset", "gpu-qwen-1.5b", "--out", "x"]
    assert result_path(out, ".json").name == "accuracy_qwen_1.5b.json"
    assert result_path(part_path(out, 2), ".md").name == "accuracy_qwen_1.5b.part2.md"
    assert result_path(tmp_path / "e2e.json", ".png").name == "e2e.png"


def test_handoff_bench_writes_its_three_rows(tmp_path, monkeypatch):
    """Plumbing only (no timing asserted): the three hand-off modes run and are written."""
    import sys

    from eval import bench_handoff

    out = tmp_path / "handoff"
    monkeypatch.setattr(sys, "argv", ["bench_handoff", "--layers", "3", "--layer-us", "20", "--job-us", "10",
                                      "--steps", "2", "--out", str(out)])
    bench_handoff.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["jobs"] for r in rows] == ["none", "inline", "thread"]
    assert all(r["ms/step (median)"] > 0 for r in rows)


def test_accuracy_suite_is_written_once_per_key_and_reused(tmp_path, monkeypatch):
    """`cached_suite`: one folder per length, written once and reused by later runs whatever other lengths they ask
    for (and by --parts workers); other samples or models get their own; a folder without its completion mark (a
    killed writer) is written again."""
    from eval import accuracy

    monkeypatch.setenv("OASIS_HF_CACHE", str(tmp_path))
    written = []

    def fake_write(folder, tokenizer, lengths, samples):
        written.append((lengths, samples))
        (folder / "x.yaml").write_text("task: x\n")

    monkeypatch.setattr(accuracy, "write_suite", fake_write)
    first = accuracy.cached_suite(None, "m", [16384, 8192], 5)
    assert written == [([8192], 5), ([16384], 5)] and len(set(first)) == 2
    assert accuracy.cached_suite(None, "m", [8192, 16384], 5) == first
    assert all(f.parent == tmp_path / "suites" and (f / "complete").is_file() for f in first)
    assert accuracy.cached_suite(None, "m", [8192], 5) == first[:1] and len(written) == 2
    assert accuracy.cached_suite(None, "m", [8192, 30000], 5)[0] == first[0] and len(written) == 3
    assert accuracy.cached_suite(None, "m", [8192], 6) != first[:1]
    assert accuracy.cached_suite(None, "other-model", [8192], 5) != first[:1]
    assert len(written) == 5
    (first[0] / "complete").unlink()
    assert accuracy.cached_suite(None, "m", [8192, 16384], 5) == first and len(written) == 6


def test_accuracy_suite_copied_to_another_cache_is_reused_and_reads_its_own_data(tmp_path, monkeypatch):
    """A suite cache written on one machine and unpacked under another OASIS_HF_CACHE (as the GPU runs do) is
    complete, so it is not written again, and its YAMLs are pointed at the new folder's data before lm-eval reads
    them (before, they named the first machine's folder and every task failed with FileNotFoundError)."""
    import shutil

    from eval import accuracy
    from tests._factories import tiny_tokenizer

    monkeypatch.setenv("OASIS_HF_CACHE", str(tmp_path / "a"))
    [first] = accuracy.cached_suite(tiny_tokenizer(), "m", [300], 1)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "a")
    monkeypatch.setenv("OASIS_HF_CACHE", str(tmp_path / "b"))
    monkeypatch.setattr(accuracy, "write_suite", lambda *args: pytest.fail("a complete suite was written again"))
    [again] = accuracy.cached_suite(None, "m", [300], 1)
    assert again.name == first.name and again.parent == tmp_path / "b" / "suites"
    yamls = sorted(again.glob("oasis_ruler_*_300.yaml"))
    assert len(yamls) == 9
    for yaml in yamls:
        data = again.resolve() / "data" / f"{yaml.stem}.jsonl"
        assert f"test: {data}\n" in yaml.read_text() and data.is_file()


def _accuracy_rows(length: int, scores: dict) -> dict:
    return {"method": "dense", "budget": "full", "length": length, **scores}


def test_accuracy_parts_merge_what_a_killed_run_left_before_starting_anew(tmp_path, monkeypatch):
    """A --parts run killed before its merge leaves its workers' rows in <out>.partK.json: the next --parts run
    merges them into --out first (it once deleted them as stale, losing a GPU call's rows), and --merge does only
    that. The workers here are real processes that exit at once (no model is loaded)."""
    import signal
    import subprocess
    import sys

    from eval import accuracy
    from eval.plot import result_path
    from eval.tasks import TASKS

    names = list(TASKS)
    out = tmp_path / "acc"
    env = {"gpu": "H200", "gpus": 2, "torch": "t", "transformers": "x", "command": "worker"}
    config = dict(accuracy.PRESETS["gpu-qwen-1.5b"])
    result_path(out, ".json").write_text(json.dumps({"config": config, "env": env, "rows": [
        _accuracy_rows(8192, {names[0]: 10.0})]}))
    for part, task in enumerate(names[1:3]):
        rows = [_accuracy_rows(8192, {task: 20.0 + part, "seconds": {task: 3.0}})]
        result_path(accuracy.part_path(out, part), ".json").write_text(
            json.dumps({"config": config, "env": env, "rows": rows}))
    started, popen = [], subprocess.Popen

    def worker(cmd, *args, **kwargs):  # the --parts workers exit at once; other processes (git) run as usual
        if "eval.accuracy" not in cmd:
            return popen(cmd, *args, **kwargs)
        started.append(cmd)
        part = int(cmd[cmd.index("--part") + 1])  # each worker finishes one task of the 16k row
        rows = [_accuracy_rows(16384, {names[part]: 60.0 + part})]
        result_path(accuracy.part_path(out, part), ".json").write_text(
            json.dumps({"config": config, "env": env, "rows": rows}))
        return popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(subprocess, "Popen", worker)
    monkeypatch.setattr(sys, "argv", ["eval.accuracy", "--preset", "gpu-qwen-1.5b", "--parts", "2", "--out", str(out),
                                      "--time-budget", "600"])
    accuracy.main()
    merged = json.loads(result_path(out, ".json").read_text())
    assert merged["rows"] == [_accuracy_rows(8192, {names[0]: 10.0, names[1]: 20.0, names[2]: 21.0,
                                                     "seconds": {names[1]: 3.0, names[2]: 3.0}}),
                              _accuracy_rows(16384, {names[0]: 60.0, names[1]: 61.0})]
    assert len(started) == 2 and all(cmd[-3:-1] == ["--part", str(k)] for k, cmd in enumerate(started))
    deadlines = {float(cmd[cmd.index("--deadline") + 1]) for cmd in started}  # one, from the parent's start
    assert len(deadlines) == 1 and not any("--time-budget" in cmd for cmd in started)
    # The leftovers were merged, then cleared for the new workers; the new workers' files are deleted once merged,
    # so the next run does not merge them again as leftovers (a duplicate `sources` entry otherwise).
    assert not list(tmp_path.glob("acc.part*")) and not list((tmp_path / "acc.claims").glob("*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    # --merge alone: the leftovers' environment is kept (the machine that measured), the merger recorded.
    result_path(accuracy.part_path(out, 1), ".json").write_text(json.dumps({"config": config, "env": env, "rows": [
        _accuracy_rows(16384, {names[0]: 50.0})]}))
    monkeypatch.setattr(sys, "argv", ["eval.accuracy", "--preset", "gpu-qwen-1.5b", "--merge", "--out", str(out)])
    accuracy.main()
    merged = json.loads(result_path(out, ".json").read_text())
    assert [r["length"] for r in merged["rows"]] == [8192, 16384] and merged["env"]["gpu"] == "H200"
    assert merged["rows"][1][names[0]] == 60.0  # --out's score is kept over the leftover's 50.0
    assert "--merge" in merged["merged_by"] and not list(tmp_path.glob("acc.part*"))
    # The table's header says whose environment it shows: a worker's (one GPU, its --part command), then the merger.
    header = result_path(out, ".md").read_text().splitlines()[0]
    assert "1 worker file of an earlier run, the first written by `worker`, merged by `" in header


def test_accuracy_parts_stop_handler_fires_once():
    """`timeout` sends SIGTERM to the --parts parent and then to its whole process group: the second signal must
    not interrupt the merge (it once did, and a stopped run merged nothing)."""
    import signal

    from eval import accuracy

    previous = signal.signal(signal.SIGTERM, accuracy._stop)
    try:
        with pytest.raises(accuracy._Stopped):
            accuracy._stop(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_accuracy_merge_from_and_relabel(tmp_path, monkeypatch):
    """--relabel renames --out's rows of a method whose definition changed; --merge-from unites other runs' rows
    (their environments listed under 'sources'), keeps --out's score where both have one, and refuses runs of
    another model and renames that would collide."""
    import sys

    from eval import _accuracy_results as accuracy_results
    from eval import accuracy
    from eval.plot import result_path
    from eval.tasks import TASKS

    names = list(TASKS)
    config = dict(accuracy.PRESETS["gpu-qwen-1.5b"])

    def write(name, rows, gpu, **cfg):
        result_path(tmp_path / name, ".json").write_text(json.dumps(
            {"config": config | cfg, "env": {"gpu": gpu, "torch": "t", "transformers": "x", "command": name,
                                             "source_sha256": name * 3}, "rows": rows}))

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["eval.accuracy", "--preset", "gpu-qwen-1.5b", *argv])
        accuracy.main()
        return json.loads(result_path(tmp_path / "main", ".json").read_text())

    old = {"method": "lookahead (draft model)", "budget": 512, "length": 8192, names[0]: 70.0}
    write("main", [old, _accuracy_rows(8192, {n: 90.0 for n in names})], "H200")
    new = {"method": "lookahead (draft model)", "budget": 512, "length": 8192, **{n: 80.0 for n in names}}
    write("later", [new, _accuracy_rows(8192, {names[0]: 1.0}), _accuracy_rows(16384, {names[0]: 60.0})], "B200")
    merged = run("--out", str(tmp_path / "main"), "--relabel", "lookahead (draft model)=lookahead (draft model, "
                 "block 32)", "--merge-from", str(tmp_path / "later.json"))
    by_key = {accuracy_results.row_key(r): r for r in merged["rows"]}
    assert by_key[("lookahead (draft model, block 32)", 512, 8192)][names[0]] == 70.0
    assert by_key[("lookahead (draft model)", 512, 8192)]["average"] == 80.0
    assert by_key[("dense", "full", 8192)][names[0]] == 90.0  # --out's score kept over the other run's
    assert by_key[("dense", "full", 16384)][names[0]] == 60.0
    assert [s["env"]["gpu"] for s in merged["sources"]] == ["H200", "B200"] and merged["env"]["gpu"] == "H200"
    assert merged["relabelled"][0]["from"] == "lookahead (draft model)"
    table = result_path(tmp_path / "main", ".md").read_text()
    assert "later.json" in table and "`lookahead (draft model)` -> `lookahead (draft model, block 32)`" in table
    # A later run resuming the united file keeps its sources and renames, and adds itself.
    payload = accuracy_results.carry_provenance(tmp_path / "main",
                                                {"env": {"gpu": "H100", "command": "again"}, "rows": []})
    assert [s["env"]["gpu"] for s in payload["sources"]] == ["H200", "B200", "H100"]
    assert payload["relabelled"] == merged["relabelled"]
    # Resuming a file one run wrote: that run becomes the first source (its command measured the rows there).
    payload = accuracy_results.carry_provenance(tmp_path / "later",
                                                {"env": {"gpu": "H100", "command": "again"}, "rows": []})
    assert [(s["file"], s["env"]["command"]) for s in payload["sources"]] == [("later.json", "later"),
                                                                          ("later.json (resumed)", "again")]
    # A file that resumed a copy of --out lists --out's sources and the runs that measured its new rows: --merge-from
    # carries those over once each, then the process that wrote the file (a --merge of a stopped run's parts).
    measured = {"file": "copy.json (resumed)", "env": {"gpu": "A100", "command": "measured"}}
    result_path(tmp_path / "copy", ".json").write_text(json.dumps(
        {"config": config, "env": {"gpu": "A100", "command": "merger"}, "sources": [*merged["sources"], measured],
         "rows": [_accuracy_rows(30000, {names[0]: 5.0})]}))
    merged = run("--out", str(tmp_path / "main"), "--merge-from", str(tmp_path / "copy.json"))
    assert [s["env"]["command"] for s in merged["sources"]] == ["main", "later", "measured", "merger"]
    # --report rewrites the markdown and keeps the rows and the command of the last merge.
    reported = run("--out", str(tmp_path / "main"), "--report")
    assert reported["merged_by"] == merged["merged_by"] and reported["rows"] == merged["rows"]
    with pytest.raises(SystemExit):  # the new rows already use the name: renaming onto them would mix two methods
        run("--out", str(tmp_path / "main"), "--relabel", "lookahead (draft model, block 32)=lookahead (draft model)")
    write("other_model", [new], "H200", model="smollm2-135m-instruct")
    with pytest.raises(SystemExit, match="model"):
        run("--out", str(tmp_path / "main"), "--merge-from", str(tmp_path / "other_model.json"))


def test_environment_records_the_code_identity_taken_when_the_run_started(monkeypatch):
    """A benchmark's `main` pins `code_identity()` before any work; sources edited later in the run (a commit made
    while a 20-minute run was going) must not relabel what it measured."""
    from eval import _common

    first = _common.code_identity()
    assert set(first) >= {"git_sha", "source_sha256"}
    monkeypatch.setattr(_common, "source_hash", lambda: "edited-later")
    assert _common.environment()["source_sha256"] == first["source_sha256"] != "edited-later"


def test_code_identity_names_a_commit_only_for_the_top_of_a_checkout(tmp_path):
    """Sources copied into a folder of another checkout (an A/B tree under an ignored folder) are not labelled with
    that checkout's commit; the top of a checkout is, and its uncommitted edits show."""
    import subprocess

    from eval import _common

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "x.py").write_text("A = 1\n")
    (tmp_path / ".gitignore").write_text("copy/\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    top = _common.git_identity(tmp_path)
    assert len(top["git_sha"]) >= 7 and top["sources_differ_from_git_sha"] is False
    (tmp_path / "eval" / "x.py").write_text("A = 2\n")
    assert _common.git_identity(tmp_path)["sources_differ_from_git_sha"] is True
    (tmp_path / "copy" / "eval").mkdir(parents=True)
    assert _common.git_identity(tmp_path / "copy") == {"git_sha": None}


def _fake_press_harness(monkeypatch, evaluate) -> None:
    """eval.accuracy's main loop with no model, suite or lm-eval run: the press rows' harness calls go to `evaluate`
    (lm-eval's ``simple_evaluate`` signature)."""
    import contextlib

    import lm_eval
    import lm_eval.tasks
    import torch

    from eval import accuracy, press_baselines

    class FakeLM:
        def __init__(self, **kwargs):
            pass

    monkeypatch.setattr(accuracy.models, "load", lambda name, device=None: (torch.nn.Linear(1, 1), "tokenizer"))
    monkeypatch.setattr(accuracy, "cached_suite", lambda *args: [])
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path: None)
    monkeypatch.setattr(press_baselines, "PressLM", FakeLM)
    monkeypatch.setattr(accuracy, "kv_shape", lambda model: {})
    monkeypatch.setattr(accuracy, "yarn_context", lambda model, tokens: contextlib.nullcontext())
    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluate)


def _press_argv(out, tasks: list[str], *extra: str) -> list[str]:
    """eval.accuracy's command line for `_fake_press_harness`: one press row at 8k, budget 512, these tasks."""
    return ["eval.accuracy", "--preset", "gpu-qwen-1.5b", "--device", "cpu", "--lengths", "8192", "--budgets", "512",
            "--tasks", *tasks, "--out", str(out), "--methods", "kvpress SnapKV (query-agnostic)", *extra]


def test_accuracy_records_a_task_that_raises_and_runs_the_rest(tmp_path, monkeypatch):
    """A task whose harness call raises (kvpress's fake-key search failing, an out-of-memory) is recorded under the
    row's 'errors' and listed under the table, the worker's other tasks still run, and the run exits non-zero
    saying which; --resume runs the task again, and its score replaces the error."""
    import sys

    from eval import _accuracy_results as accuracy_results
    from eval import accuracy
    from eval.plot import result_path

    broken = {"oasis_ruler_vt_8192"}

    def evaluate(model, tasks, task_manager, **kwargs):
        if tasks[0] in broken:
            raise ValueError("Could not find fake keys such that for every query q, exp(<q, k>) = 0")
        return {"results": {tasks[0]: {"score,none": 50.0}}}

    _fake_press_harness(monkeypatch, evaluate)
    out = tmp_path / "acc"
    argv = _press_argv(out, ["niah_single", "vt", "qa"])
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="1 task.*vt"):
        accuracy.main()
    (row,) = json.loads(result_path(out, ".json").read_text())["rows"]
    assert row["niah_single"] == row["qa"] == 50.0 and "vt" not in row  # the task after the failure ran too
    assert row["errors"] == {"vt": "ValueError: Could not find fake keys such that for every query q, exp(<q, k>) = 0"}
    assert "Tasks that raised" in result_path(out, ".md").read_text()
    broken.clear()
    monkeypatch.setattr(sys, "argv", [*argv, "--resume"])
    accuracy.main()
    (row,) = json.loads(result_path(out, ".json").read_text())["rows"]
    assert row["vt"] == 50.0 and "errors" not in row
    assert "Tasks that raised" not in result_path(out, ".md").read_text()
    # Rows united from runs keep an error only where no run scored the task.
    failed = {"method": "m", "budget": 512, "length": 8192, "errors": {"vt": "E", "qa": "E"}}
    (merged,) = accuracy_results.merge_rows([failed], [{"method": "m", "budget": 512, "length": 8192, "vt": 1.0}])
    assert merged["errors"] == {"qa": "E"} and merged["vt"] == 1.0


def test_accuracy_tries_a_task_that_ran_out_of_gpu_memory_once_more_after_the_others(tmp_path, monkeypatch):
    """A task that runs out of GPU memory (--parts workers sharing a GPU, their peaks meeting) is tried again once
    after the worker's other tasks: a success there leaves no error and a zero exit; a second out-of-memory is
    recorded and fails the run. Any other exception is not retried."""
    import sys

    import torch

    from eval import accuracy
    from eval.plot import result_path

    calls, memory = [], {"oasis_ruler_vt_8192": 1}  # task -> out-of-memory errors still to raise

    def evaluate(model, tasks, task_manager, **kwargs):
        calls.append(tasks[0])
        if memory.get(tasks[0], 0):
            memory[tasks[0]] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.01 GiB")
        if tasks[0] == "oasis_ruler_qa_8192":
            raise ValueError("not a memory error")
        return {"results": {tasks[0]: {"score,none": 50.0}}}

    _fake_press_harness(monkeypatch, evaluate)
    out = tmp_path / "acc"
    monkeypatch.setattr(sys, "argv", _press_argv(out, ["vt", "niah_single", "qa"]))
    with pytest.raises(SystemExit) as stop:
        accuracy.main()
    assert "qa" in str(stop.value) and "vt" not in str(stop.value)  # only the non-memory error fails the run
    # vt again after the others; qa (another error) only once
    assert [c.split("_")[2] for c in calls] == ["vt", "niah", "qa", "vt"]
    (row,) = json.loads(result_path(out, ".json").read_text())["rows"]
    assert row["vt"] == row["niah_single"] == 50.0 and set(row["errors"]) == {"qa"}
    calls.clear()
    memory["oasis_ruler_vt_8192"] = 2  # out of memory on both tries: recorded, and the run fails naming it
    monkeypatch.setattr(sys, "argv", _press_argv(tmp_path / "again", ["vt"]))
    with pytest.raises(SystemExit, match="1 task.*vt"):
        accuracy.main()
    assert calls == ["oasis_ruler_vt_8192"] * 2
    (row,) = json.loads(result_path(tmp_path / "again", ".json").read_text())["rows"]
    assert row["errors"]["vt"].startswith("OutOfMemoryError") and "vt" not in {k for k in row if k != "errors"}


def test_accuracy_loads_the_draft_only_for_a_row_that_runs_with_it(tmp_path, monkeypatch):
    """A run of baseline rows never loads the draft (a GPU session that runs only the presses need not carry its
    weights); the first drafted row loads it once and hands it to every drafted row; a drafted method on a preset
    without a draft stops before any model is loaded."""
    import contextlib
    import sys

    import lm_eval
    import lm_eval.tasks
    import torch

    from eval import accuracy, press_baselines
    from oasis_hf.integrations import lm_eval as oasis_lm_eval

    loaded, made = [], []

    def load(name, device=None):
        loaded.append(name)
        return torch.nn.Linear(1, 1), f"tokenizer of {name}"

    class FakeLM:
        def __init__(self, **kwargs):
            made.append(kwargs)

    monkeypatch.setattr(accuracy.models, "load", load)
    monkeypatch.setattr(accuracy, "cached_suite", lambda *args: [])
    reports, calls = [], []
    monkeypatch.setattr(accuracy, "report", lambda args, preset, model, rows, *a, **k: reports.append(
        [dict(row) for row in rows]))
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda include_path: None)

    def evaluate(model, tasks, task_manager, **kwargs):
        calls.append(kwargs)
        return {"results": {tasks[0]: {"score,none": 50.0}}}

    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluate)
    monkeypatch.setattr(oasis_lm_eval, "OasisLM", FakeLM)
    monkeypatch.setattr(press_baselines, "PressLM", FakeLM)
    monkeypatch.setattr(accuracy, "kv_shape", lambda model: {})
    monkeypatch.setattr(accuracy, "yarn_context", lambda model, tokens: contextlib.nullcontext())

    def run(*methods, preset="gpu-qwen-1.5b", extra=()):
        loaded.clear(), made.clear()
        monkeypatch.setattr(sys, "argv", ["eval.accuracy", "--preset", preset, "--device", "cpu", "--lengths", "8192",
                                          "--budgets", "512", "--tasks", "niah_single", "--out",
                                          str(tmp_path / "acc"), *extra, "--methods", *methods])
        accuracy.main()

    run("static (StreamingLLM)", "kvpress SnapKV (query-aware)")
    assert loaded == ["qwen2.5-coder-1.5b-instruct"] and len(made) == 2
    assert not any("draft_model" in kwargs for kwargs in made)

    run("static (StreamingLLM)", "lookahead (draft model)", "lookahead (draft model, mean summaries)")
    assert loaded == ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"] and len(made) == 3
    assert "draft_model" not in made[0] and made[1]["draft_model"] is made[2]["draft_model"] is not None

    with pytest.raises(SystemExit):
        run("lookahead (draft model)", preset="cpu-smollm2-2k")
    assert loaded == []
    # The chat-template sensitivity check: lm-eval wraps the prompts, and the rows say so in their name.
    assert calls and all(call["apply_chat_template"] is False for call in calls)
    run("static (StreamingLLM)", extra=("--chat-template",))
    assert calls[-1]["apply_chat_template"] is True
    assert reports[-1][-1]["method"] == "static (StreamingLLM) [chat template]"


def test_floor_bench_runs_every_kind_of_row_in_one_process(tmp_path, monkeypatch):
    """Plumbing only, on the CPU (nothing captured, no timing asserted): each point gets its dense rows (the graphed
    one checked against eager dense attention), its OasisKV rows through DecodeGraph and its floor rows, with the
    fields the acceptance checks read, the real-model delta rate replayed as the lookahead cap, and the lookahead
    rows again with --sync-fetch-blocks."""
    import sys

    from eval import bench_floor

    rate = tmp_path / "rate.json"
    rate.write_text(json.dumps({"rows": [
        {"task": "qa", "method": "lookahead, plain decoding", "blocks/(seq, head, forward)": 2.4},
        {"task": "qa", "method": "lookahead, draft model (speculative_generate)", "blocks/(seq, head, forward)": 6.0,
         "forwards": 4, "new tokens": 16, "blocks/(seq, head, token)": 1.5}]}))
    out = tmp_path / "floor"
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x600",
                                      "--budget", "256", "--warmup", "1", "--repeats", "2", "--dense-kernels", "sdpa",
                                      "--delta-rate", str(rate), "--compile-model", "off", "--sync-fetch-blocks", "2",
                                      "--out", str(out)])
    bench_floor.main()
    payload = json.loads(out.with_suffix(".json").read_text())
    rows = payload["rows"]
    # Every OasisKV row carries the delta it moved per step and that delta over the host-to-device bandwidth the run
    # measured; static moves nothing, lookahead on random K/V moves its cap.
    assert payload["h2d_bytes_per_s"] > 0
    oasis = [r for r in rows if r["kind"].startswith("oasis")]
    for row in oasis:
        assert row["PCIe floor ms"] == pytest.approx(1e3 * row["delta MB/step"] * 1e6 / payload["h2d_bytes_per_s"])
    assert all(r["delta MB/step"] == 0 for r in oasis if r["kind"] == "oasis-static")
    assert all(r["delta MB/step"] > 0 for r in oasis if r["kind"] == "oasis-lookahead")
    # Each lookahead row again with the in-step correction, labelled; no other row gets it.
    corrected = [r for r in rows if r["method"].endswith(", sync_fetch_blocks=2")]
    assert sorted(r["kind"] for r in corrected) == ["oasis-lookahead", "oasis-lookahead"]
    rows = [r for r in rows if r not in corrected]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"dense-eager", "dense-graphed", "floor", "oasis-static", "oasis-lookahead", "oasis-current-query"}
    for row in rows:
        assert {"method", "kind", "batch", "context", "ms_per_step"} <= set(row), row
        assert row["batch"] == 2 and row["context"] == 600 and row["ms_per_step"] > 0
    graphed = next(r for r in rows if r["kind"] == "dense-graphed")
    assert graphed["logit check"]["same argmax"] and graphed["logit check"]["max abs logit diff"] < 1e-4
    real = [r for r in rows if "real-model delta rate" in r["method"]]
    assert len(real) == 1 and real[0]["max_fetch_blocks"] == 3  # the plain-decoding rate, rounded up
    assert "6.00 per forward of 4.0 tokens" in real[0]["note"]
    assert out.with_suffix(".md").read_text().count("| floor |") == 2  # the kind column of the two floor rows


def test_floor_bench_compiled_rows_carry_their_label_and_logit_check(tmp_path, monkeypatch):
    """Plumbing only, on the CPU: with --compile-model only, the dense-graphed row and the OasisKV row run the model
    through torch.compile (Inductor on the CPU), are labelled so and flagged `compiled`, and the compiled dense step
    is checked against eager dense attention."""
    import sys

    import torch._dynamo

    from eval import bench_floor

    out = tmp_path / "floor"
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x300",
                                      "--budget", "256", "--warmup", "1", "--repeats", "2", "--dense-kernels", "sdpa",
                                      "--methods", "dense-graphed", "oasis-static", "--compile-model", "only",
                                      "--out", str(out)])
    try:
        bench_floor.main()
    finally:
        torch._dynamo.reset()
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    dense = rows["dense graphed (sdpa, torch.compile)"]
    oasis = rows["OasisKV static @256 (whole-step graph, torch.compile)"]
    assert dense["compiled"] and oasis["compiled"] and oasis["step vs static"] == 1
    assert dense["logit check"]["compiled"] and dense["logit check"]["max abs logit diff"] < 1e-4
    assert "dense graphed (sdpa)" not in rows  # only the compiled variants


def test_floor_bench_runs_one_row_per_fetch_program_cap(tmp_path, monkeypatch):
    """Plumbing only, on the CPU: --fetch-programs with several values gives the fetching OasisKV rows one variant
    each, labelled and configured with its cap, in the same process; static selection (which moves nothing) runs
    once at the library's cap."""
    import sys

    from eval import bench_floor

    out = tmp_path / "floor"
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x300",
                                      "--budget", "256", "--warmup", "1", "--repeats", "2", "--compile-model", "off",
                                      "--methods", "oasis-static", "oasis-lookahead", "--fetch-programs", "2", "none",
                                      "--out", str(out)])
    bench_floor.main()
    rows = [r for r in json.loads(out.with_suffix(".json").read_text())["rows"] if r["kind"].startswith("oasis")]
    assert [(r["kind"], r["fetch_programs"]) for r in rows] == [
        ("oasis-static", 16), ("oasis-lookahead", 2), ("oasis-lookahead", None)]
    assert rows[0]["method"] == "OasisKV static @256 (whole-step graph)"
    assert rows[1]["method"].endswith(", fetch_programs=2") and rows[2]["method"].endswith(", fetch_programs=None")
    assert all(r["step vs static"] > 0 for r in rows)


def test_floor_bench_interval_variant_runs_whole_cycles_and_scales_the_replayed_delta(tmp_path, monkeypatch, capsys):
    """Plumbing only, on the CPU: a --variant with selection_interval=N runs no static row of its own (static
    selection runs no jobs; its lookahead row compares with the base static row), replays N steps' worth of the
    real-model rate per job, takes the mean over whole job cycles as its step, and an odd --repeats is refused."""
    import sys

    from eval import bench_floor

    rate = tmp_path / "rate.json"
    rate.write_text(json.dumps({"rows": [
        {"task": "qa", "method": "lookahead, plain decoding", "blocks/(seq, head, forward)": 2.4}]}))
    out = tmp_path / "floor"
    argv = ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x600", "--budget", "256",
            "--warmup", "1", "--repeats", "4", "--compile-model", "off", "--delta-rate", str(rate),
            "--methods", "oasis-static", "oasis-lookahead-real", "--variant", "every2", "selection_interval=2",
            "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_floor.main()
    rows = [r for r in json.loads(out.with_suffix(".json").read_text())["rows"] if r["kind"].startswith("oasis")]
    assert [(r["kind"], r["variant"]) for r in rows] == [
        ("oasis-static", ""), ("oasis-lookahead", ""), ("oasis-lookahead", "every2")]
    base, every2 = rows[1], rows[2]
    assert (base["max_fetch_blocks"], every2["max_fetch_blocks"]) == (3, 5)  # ceil(2.4), ceil(2 * 2.4)
    assert "(5 blocks per (seq, head, job, one per 2 steps))" in every2["method"]
    assert every2["selection_interval"] == 2 and every2["ms_per_step"] == every2["ms/step (mean)"]
    assert base["ms_per_step"] == base["ms/step (median)"]
    assert every2["step vs static"] == every2["ms_per_step"] / rows[0]["ms_per_step"]
    monkeypatch.setattr(sys, "argv", [a if a != "4" else "3" for a in argv])
    with pytest.raises(SystemExit):
        bench_floor.main()
    assert "needs --repeats a multiple of it" in capsys.readouterr().err


def test_floor_bench_config_sets_every_oasis_row_and_its_floor(tmp_path, monkeypatch, capsys):
    """Plumbing only, on the CPU: --config sets OasisConfig fields of every OasisKV row (labelled with them, recorded
    in the row) and the sparse floor counts the summaries they keep; fields the benchmark sets itself are refused
    with the reason, before any model is built."""
    import sys

    import torch

    from eval import bench_floor
    from eval._harness import SHAPES, build_model

    out = tmp_path / "floor"
    setting = ["block_size=16", "sink_tokens=16", "recent_tokens=64", "summary=mean+minmax"]
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x300",
                                      "--budget", "256", "--warmup", "1", "--repeats", "2", "--compile-model", "off",
                                      "--methods", "oasis-static", "oasis-lookahead", "--config", *setting,
                                      "--out", str(out)])
    bench_floor.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    oasis = [r for r in rows if r["kind"].startswith("oasis")]
    assert len(oasis) == 2
    for row in oasis:
        assert row["method"].endswith(", " + " ".join(setting)) and row["ms_per_step"] > 0
        assert (row["block_size"], row["summary"]) == (16, "mean+minmax")
    sparse = next(r for r in rows if r["method"].startswith("floor, sparse"))
    assert "mean+minmax summaries of blocks of 16" in sparse["method"]
    # Three summary vectors per 16 tokens read more than one per 32: the floor rises with them.
    model = build_model(SHAPES["tiny"], "meta", torch.float32)
    plain = bench_floor.floor_rows(model, 256, 2, 30000, 1e12)[1]["ms/step (median)"]
    both = bench_floor.floor_rows(model, 256, 2, 30000, 1e12, {"block_size": 16, "sink_tokens": 16,
                                                              "recent_tokens": 64, "summary": "mean+minmax"})
    assert both[1]["ms/step (median)"] > plain
    for bad, said in ((["--config", "max_fetch_blocks=4"], "this script sets those"),
                      (["--config", "block_size=24"], "power of two"),
                      (["--variant", "v", "fetch_programs=2"], "this script sets those"),
                      (["--variant", "block_size=16"], "write a new NAME")):
        monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--methods", "oasis-static", *bad])
        with pytest.raises(SystemExit):
            bench_floor.main()
        assert said in capsys.readouterr().err


def test_floor_bench_variant_runs_every_oasis_row_again_in_the_same_process(tmp_path, monkeypatch):
    """Plumbing only, on the CPU: --variant runs each OasisKV row once more with its fields, in this process,
    labelled; its step is compared with its own static row, and it gets a sparse floor of its own. The real-model
    delta rate, measured with blocks of 32, is replayed in the variant's blocks of 16 as the same bytes."""
    import os
    import sys

    from eval import bench_floor

    rate = tmp_path / "rate.json"
    rate.write_text(json.dumps({"oasis_config": {"block_size": 32}, "rows": [
        {"task": "qa", "method": "lookahead, plain decoding", "blocks/(seq, head, forward)": 2.4}]}))
    out = tmp_path / "floor"
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x300",
                                      "--budget", "256", "--warmup", "1", "--repeats", "2", "--compile-model", "off",
                                      "--methods", "oasis-static", "oasis-lookahead-real", "--delta-rate", str(rate),
                                      "--variant", "suite",
                                      "block_size=16", "sink_tokens=16", "recent_tokens=64", "summary=mean+minmax",
                                      "--out", str(out)])
    bench_floor.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    oasis = [r for r in rows if r["kind"].startswith("oasis")]
    assert [(r["kind"], r["variant"], r["block_size"]) for r in oasis] == [
        ("oasis-static", "", 32), ("oasis-lookahead", "", 32),
        ("oasis-static", "suite", 16), ("oasis-lookahead", "suite", 16)]
    assert [r["max_fetch_blocks"] for r in oasis if r["kind"] == "oasis-lookahead"] == [3, 5]  # 2.4, then 4.8 up
    assert "replayed here as the same bytes in blocks of 16" in oasis[3]["note"]
    assert "same bytes" not in oasis[1]["note"]
    assert all(r["pid"] == os.getpid() for r in oasis)
    suite = [r for r in oasis if r["variant"] == "suite"]
    assert all(r["method"].endswith(" [suite: block_size=16 sink_tokens=16 recent_tokens=64 summary=mean+minmax]")
               for r in suite)
    for r in oasis:  # each against the static step of its own setting
        static = next(s for s in oasis if s["kind"] == "oasis-static" and s["variant"] == r["variant"])
        assert r["step vs static"] == pytest.approx(r["ms_per_step"] / static["ms_per_step"])
    floors = [r["method"] for r in rows if r["kind"] == "floor"]
    assert len(floors) == 3 and floors[2].endswith("mean+minmax summaries of blocks of 16 read once) [suite]")


def test_floor_bench_isolate_times_every_method_in_a_process_of_its_own(tmp_path, monkeypatch):
    """Plumbing only, on the CPU: with --isolate each method runs in a child process (its rows carry the child's
    pid), and the parent adds the floor rows and the ratios across them."""
    import os
    import sys

    from eval import bench_floor

    out = tmp_path / "floor"
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--device", "cpu", "--shape", "tiny", "--points", "2x300",
                                      "--budget", "256", "--warmup", "1", "--repeats", "2", "--compile-model", "off",
                                      "--methods", "oasis-static", "oasis-lookahead", "--isolate", "--out", str(out)])
    bench_floor.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    timed = [r for r in rows if r["kind"].startswith("oasis")]
    assert [r["kind"] for r in timed] == ["oasis-static", "oasis-lookahead"]
    pids = {r["pid"] for r in timed}
    assert len(pids) == 2 and os.getpid() not in pids
    assert [r["kind"] for r in rows].count("floor") == 2
    assert timed[0]["step vs static"] == 1 and timed[1]["step vs static"] > 0  # the parent's ratios


def test_floor_bench_runs_one_compiled_variant_per_mode_and_labels_it():
    import argparse

    from eval.bench_floor import compile_variants
    from eval.dense_baselines import graphed_label

    args = argparse.Namespace(compile_model="also", compile_modes=["default", "max-autotune-no-cudagraphs"])
    assert compile_variants(args) == [(False, None), (True, None), (True, "max-autotune-no-cudagraphs")]
    args.compile_model = "off"
    assert compile_variants(args) == [(False, None)]
    assert graphed_label("sdpa", True, "max-autotune-no-cudagraphs") == (
        "dense graphed (sdpa, torch.compile max-autotune-no-cudagraphs)")
    assert graphed_label("sdpa", False, "max-autotune-no-cudagraphs") == "dense graphed (sdpa)"


def test_generate_path_bench_runs_its_decode_and_prefill_rows(tmp_path, monkeypatch):
    """Plumbing only, on the CPU (no graphs, no timing asserted): per selector the DecodeGraph row, the
    model.generate rows through the forward wrapper (queued loop, with the host profile, and transformers' loop) and
    the per-layer path, and the prefill rows of dense and OasisKV (fresh and from a warm pool), with the fields the
    acceptance reads."""
    import sys

    from eval import bench_generate_path

    out = tmp_path / "generate_path"
    monkeypatch.setattr(sys, "argv", ["bench_generate_path", "--device", "cpu", "--points", "2x300",
                                      "--prefill-points", "2x300", "--prefill-chunk", "128", "--warmup", "1",
                                      "--repeats", "2", "--out", str(out)])
    bench_generate_path.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert not [r for r in rows if r["kind"] == "error"], rows
    decode = [r for r in rows if r["kind"] == "decode"]
    paths = ("DecodeGraph", "model.generate", "model.generate (transformers' loop)", "model.generate (per-layer)")
    assert sorted((r["selector"], r["path"]) for r in decode) == sorted(
        (s, p) for s in ("static", "lookahead") for p in paths)
    for row in decode:
        assert {"path", "batch", "context", "ms_per_step"} <= set(row) and row["ms_per_step"] > 0
        assert len(row["raw_ms"]) == 2 and (row["batch"], row["context"]) == (2, 300)
    profiled = [r for r in decode if r["path"] == "model.generate"]
    assert all(r["host profile (top own time)"] and r["host ms/step (profiled)"] > 0 for r in profiled)
    prefill = {r["method"]: r for r in rows if r["kind"] == "prefill"}
    assert set(prefill) == {"dense", "oasis", "oasis, warm host pool", "dense, chunks of 128",
                            "oasis, chunks of 128"}
    assert all(r["seconds"] > 0 and r["batch"] == 2 and r["context"] == 300 for r in prefill.values())


def test_dense_graphed_generate_gives_the_tokens_of_generate():
    """The end-to-end dense baseline (prefill, K/V copied into preallocated buffers, each step the captured forward
    reading its length from device memory; eager with the kernel's twin on the CPU) decodes a left-padded batch to
    the tokens of transformers' greedy generate over a DynamicCache, and leaves the model's attention as it was."""
    import torch
    from transformers import DynamicCache

    from eval.dense_baselines import dense_graphed_generate
    from tests._factories import tiny_model
    from tests.test_generate import left_padded

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # no stop and no EOS suppression: plain argmax, as the baseline
    ids, mask = left_padded([150, 97, 131])
    ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                         max_new_tokens=12, do_sample=False, pad_token_id=0)
    before = model.config._attn_implementation
    out, ttft = dense_graphed_generate(model, ids, mask, max_new_tokens=12)
    assert torch.equal(out, ref) and ttft > 0
    assert model.config._attn_implementation == before


def test_dense_graphed_generate_with_a_session_decodes_each_call_as_a_fresh_one():
    """Buffers kept across calls (`DenseGraphedSession`, a server's way): a second prompt of the same shape, and one of
    another batch size (the session's buffers replaced), decode as calls without a session."""
    import torch

    from eval.dense_baselines import DenseGraphedSession, dense_graphed_generate
    from tests._factories import tiny_model
    from tests.test_generate import left_padded

    model = tiny_model("llama")
    session = DenseGraphedSession()
    for lengths, seed in (([150, 97], 1), ([131, 140], 2), ([120], 3)):
        ids, mask = left_padded(lengths, seed=seed)
        out, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=8, capacity=170, session=session)
        ref, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=8, capacity=170)
        assert torch.equal(out, ref) and session.key[0] == len(lengths)


@pytest.mark.gpu
def test_dense_graphed_generate_with_a_session_captures_once_on_cuda():
    """On CUDA the session's second call of the same shape replays the step the first captured (no eager step, no
    capture) and decodes as a call without a session."""
    import torch

    from eval.dense_baselines import DenseGraphedSession, dense_graphed_generate
    from tests._factories import tiny_model
    from tests.test_generate import left_padded

    model = tiny_model("llama", device="cuda")
    session = DenseGraphedSession()
    for seed in (1, 2):
        ids, mask = (t.cuda() for t in left_padded([150, 97], seed=seed))
        out, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=8, capacity=170, session=session)
        ref, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=8, capacity=170)
        assert torch.equal(out, ref) and session.captures == 1


def test_dense_graphed_generate_compiled_gives_the_same_tokens():
    """The compiled variant of the end-to-end dense baseline (the model through torch.compile in every decode step;
    Inductor on the CPU) decodes the tokens of the eager one."""
    import torch
    import torch._dynamo

    from eval.dense_baselines import dense_graphed_generate
    from tests._factories import tiny_model
    from tests.test_generate import left_padded

    model = tiny_model("llama")
    ids, mask = left_padded([70, 51])
    ref, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=6)
    try:
        out, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=6, compiled=True)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, ref)


def test_dense_graphed_generate_compiled_reuses_its_compilation_at_one_capacity():
    """A warm-up and a longer timed call at the same `capacity` share one compilation (the end-to-end bench relies on
    it: a recompile in the timed row is tens of seconds on a GPU); a capacity too small for the call is refused."""
    import pytest
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from eval.dense_baselines import dense_graphed_generate
    from tests._factories import tiny_model
    from tests.test_generate import left_padded

    model = tiny_model("llama")
    ids, mask = left_padded([70, 51])
    try:
        dense_graphed_generate(model, ids, mask, max_new_tokens=4, compiled=True, capacity=70 + 40)
        graphs = counters["stats"]["unique_graphs"]
        out, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=40, compiled=True, capacity=70 + 40)
        assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
        ref, _ = dense_graphed_generate(model, ids, mask, max_new_tokens=40)
        assert torch.equal(out, ref)
        with pytest.raises(ValueError, match="capacity=100 is below"):
            dense_graphed_generate(model, ids, mask, max_new_tokens=40, compiled=True, capacity=100)
    finally:
        torch._dynamo.reset()


def test_accuracy_rows_count_every_gpu_byte_of_their_method(monkeypatch):
    """The memory columns of the accuracy tables: Qwen2.5-Coder-1.5B (28 layers, 2 KV heads of 128, bf16) at 16k
    tokens: dense keeps the prompt's KV (448 MiB); OasisKV @2048 its pool (56 MiB) plus mean+minmax summaries of
    blocks of 16 (3 x 1,024 blocks: 42 MiB) plus, with the 0.5B draft (24 layers, 2 KV heads of 64), the draft's
    KV of the whole prompt (192 MiB, 43% of the target's per token) and its weights apart; a press its budget."""
    from eval._accuracy_results import memory_columns

    shapes = {"model": dict(layers=28, kv_heads=2, head_dim=128, element_bytes=2, weight_bytes=3 * 2**30),
              "draft": dict(layers=24, kv_heads=2, head_dim=64, element_bytes=2, weight_bytes=2**30)}
    row = dict(budget=2048, length=16384)
    dense = memory_columns(row | {"method": "dense", "budget": "full"}, shapes)
    assert dense == {"target KV MiB/seq": 448.0, "GPU total MiB/seq": 448.0}
    ours = memory_columns(row | {"method": "lookahead (draft model)"}, shapes)
    assert ours == {"target KV MiB/seq": 56.0, "summaries MiB/seq": 42.0, "draft KV MiB/seq": 192.0,
                    "draft weights MiB": 1024.0, "GPU total MiB/seq": 290.0}
    press = memory_columns(row | {"method": "kvpress SnapKV (query-aware)"}, shapes)
    assert press == {"target KV MiB/seq": 56.0, "GPU total MiB/seq": 56.0}
    assert memory_columns(row | {"method": "a method of an older run"}, shapes) == {}
    # Layers with budgets of their own: two layers at 16k (one covering the prompt, one capped by it) and one at 512.
    import eval.accuracy as accuracy

    own = {"layer_budget_tokens": {0: 16384, 1: 32768, 2: 512}}
    monkeypatch.setitem(accuracy.METHODS, "per-layer", accuracy.METHODS["lookahead (draft model)"] | own)
    layered = memory_columns(row | {"method": "per-layer"}, shapes)
    assert layered["target KV MiB/seq"] == pytest.approx((25 * 2048 + 2 * 16384 + 512) * 2 * 2 * 128 * 2 / 2**20)


def test_accuracy_bytes_table_ranks_rows_by_gpu_bytes_and_carries_the_best_cheaper_average():
    """The equal-bytes view: per length, complete rows fewest GPU bytes first, each with the best average of any row
    holding no more; incomplete rows and rows of another length stay apart."""
    from eval._accuracy_results import bytes_table

    rows = [dict(method="dense", budget="full", length=8192, average=89.0, **{"GPU total MiB/seq": 224.0}),
            dict(method="b", budget=512, length=8192, average=86.0, **{"GPU total MiB/seq": 35.0}),
            dict(method="a", budget=2048, length=8192, average=80.0, **{"GPU total MiB/seq": 70.0}),
            dict(method="c", budget=512, length=8192, **{"GPU total MiB/seq": 10.0}),  # tasks missing
            dict(method="a", budget=2048, length=16384, average=70.0, **{"GPU total MiB/seq": 98.0})]
    lines = [line for line in bytes_table(rows).splitlines() if line.startswith("| ") and "length" not in line]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert [(c[0], c[1], c[5]) for c in cells] == [("8192", "b", "86"), ("8192", "a", "86"), ("8192", "dense", "89"),
                                                   ("16384", "a", "70")]


def test_yarn_context_stretches_the_rotary_embedding_for_long_rows_only():
    """Rows beyond the model's trained window run with YaRN (factor 2 over a 4k window for 6k tokens: transformers'
    yarn parameters, attention scaled by 0.1 ln 2 + 1); rows within it, and every row after the block, run the model
    as trained: the same logits to the bit."""
    import math

    import torch

    from eval._harness import yarn_context
    from tests._factories import tiny_model

    model = tiny_model("qwen2")
    ids = torch.randint(3, 100, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(ids).logits
        with yarn_context(model, 4000) as factor:
            assert factor == 1.0 and torch.equal(model(ids).logits, trained)
        with yarn_context(model, 6000) as factor:
            assert factor == 2.0 and model.config.max_position_embeddings == 8192
            assert model.config.rope_parameters["rope_type"] == "yarn"
            assert math.isclose(model.model.rotary_emb.attention_scaling, 0.1 * math.log(2) + 1)
            stretched = model(ids).logits
        assert not torch.equal(stretched, trained)
        assert model.config.max_position_embeddings == 4096 and model.config.rope_parameters["rope_type"] == "default"
        assert torch.equal(model(ids).logits, trained)


def test_profile_families_sort_inductor_gemms_apart_from_its_elementwise_kernels():
    from eval._harness import family

    gemm = "weight GEMMs in Inductor kernels (mm templates; mm as reductions, fused with norms)"
    assert family("triton_red_fused__to_copy_add_mean_mm_mul_pow_rsqrt_t_view_1") == gemm  # norm + QKV as one reduction
    assert family("triton_tem_fused_mm_t_view_4") == gemm
    assert family("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0").startswith("Inductor fused kernels")
    assert family("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT") == "weight GEMMs"
    assert family("_sparse_attention_kernel") == "sparse attention"


def test_floor_bench_replays_one_task_delta_rate_from_the_committed_result():
    from eval.bench_floor import delta_rate

    path = RESULTS / "delta_rate_qwen1.5b_16k.json"
    recall_list, note, block_size = delta_rate(path, "recall_list")
    assert math.ceil(recall_list) == 5 and "recall_list" in note and "qa" not in note
    assert note.startswith(f"qwen2.5-coder-1.5b-instruct's lookahead moved {recall_list:.2f} blocks per (seq, head, "
                           "layer-step) at 16384 tokens in plain decoding; with the draft model (recall_list)")
    variant = delta_rate(RESULTS / "delta_rate_qwen0.5b_8k_keep_margin_0.5.json")  # plain decoding only
    assert variant[0] == pytest.approx(2.12, abs=0.005)
    assert variant[1] == ("qwen2.5-coder-0.5b-instruct's lookahead (keep_margin=0.5) moved 2.12 blocks per (seq, "
                          "head, layer-step) at 8192 tokens in plain decoding")
    assert block_size == 32  # measured with the library's blocks (its oasis_config)
    assert delta_rate(path)[0] > recall_list  # the qa rows move more
    with pytest.raises(SystemExit, match="no rows of task"):
        delta_rate(path, "no-such-task")


def test_accuracy_time_budget_starts_only_tasks_expected_to_end_in_it(tmp_path, monkeypatch):
    """--time-budget: a task starts only if its row's task times so far say it ends within the budget (a hard
    `timeout` after it then kills no task in flight); a row with no time known yet starts; what was not started
    stays missing (no error, exit 0) for --resume. The workers of --parts get one deadline, not the budget."""
    import sys
    import types

    from eval import accuracy
    from eval.plot import result_path

    clock = [1000.0]
    monkeypatch.setattr(accuracy, "time", types.SimpleNamespace(time=lambda: clock[0], perf_counter=lambda: clock[0]))

    def evaluate(model, tasks, task_manager, **kwargs):
        clock[0] += 40.0  # every task takes 40 s
        return {"results": {tasks[0]: {"score,none": 50.0}}}

    _fake_press_harness(monkeypatch, evaluate)
    out = tmp_path / "acc"
    monkeypatch.setattr(sys, "argv", _press_argv(out, ["niah_single", "vt", "qa"], "--time-budget", "100"))
    accuracy.main()  # 0 s: starts (nothing known); 40 s: 40 more fit in 100; 80 s: they do not
    (row,) = json.loads(result_path(out, ".json").read_text())["rows"]
    assert (row["niah_single"], row["vt"]) == (50.0, 50.0) and "qa" not in row and "errors" not in row
    # Recorded times (another run, maybe other hardware) count by their median until this run measures its own.
    previous = {("m", 512, 8192): {"seconds": {"a": 10.0, "b": 30.0, "c": 500.0}},
                ("m", 2048, 16384): {"seconds": {"a": 99.0}}}
    assert accuracy.expected_seconds({}, previous, "m", 8192) == 30.0
    assert accuracy.expected_seconds({("m", 8192): [5.0, 7.0]}, previous, "m", 8192) == 7.0
    assert accuracy.expected_seconds({}, previous, "other", 8192) == 0.0
    assert accuracy.worker_argv(["--out", "x", "--time-budget", "100", "--parts", "2"]) == ["--out", "x"]


def test_floor_bench_combine_keeps_every_run_and_tags_its_rows(tmp_path, monkeypatch, capsys):
    """--combine: one results file from runs of one point each; rows unchanged but for the run they came from, each
    run's environment and command kept; a call without runs is refused with the usage."""
    import sys

    from eval import bench_floor

    runs = []
    for point, ms in (("8x32512", 6.0), ("1x130560", 5.5)):
        batch, context = (int(x) for x in point.split("x"))
        run = tmp_path / f"floor_{point}.json"
        run.write_text(json.dumps({
            "env": {"gpu": "GPU", "torch": "t", "source_sha256": "abc", "command": f"bench --points {point}"},
            "hbm_bytes_per_s": 4e12, "h2d_bytes_per_s": 5e10, "rows": [
                {"method": "dense graphed (sdpa)", "kind": "dense-graphed", "batch": batch, "context": context,
                 "ms_per_step": 2 * ms, "speed-up vs dense graphed": 1.0},
                {"method": "OasisKV static @2048", "kind": "oasis-static", "batch": batch, "context": context,
                 "ms_per_step": ms, "speed-up vs dense graphed": 2.0}]}))
        runs.append(run)
    out = tmp_path / "floor_all"
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--combine", str(out), *map(str, runs)])
    bench_floor.main()
    payload = json.loads(out.with_suffix(".json").read_text())
    assert [(r["run"], r["kind"], r["batch"], r["ms_per_step"]) for r in payload["rows"]] == [
        ("floor_8x32512", "dense-graphed", 8, 12.0), ("floor_8x32512", "oasis-static", 8, 6.0),
        ("floor_1x130560", "dense-graphed", 1, 11.0), ("floor_1x130560", "oasis-static", 1, 5.5)]
    assert [r["env"]["command"] for r in payload["runs"]] == ["bench --points 8x32512", "bench --points 1x130560"]
    assert payload["env"]["command"] == payload["command"] and payload["command"].startswith(
        f"python -m eval.bench_floor --combine {out} ")
    from eval import plot

    drawn = []
    monkeypatch.setattr(plot, "plot_floor", lambda payload, path: drawn.append(path))
    plot.main([str(out.with_suffix(".json"))])  # the combined file alone redraws as a floor figure
    assert drawn == [out.with_suffix(".json")]
    table = out.with_suffix(".md").read_text()
    assert "`bench --points 8x32512`" in table and "`bench --points 1x130560`" in table
    monkeypatch.setattr(sys, "argv", ["bench_floor", "--combine", str(out)])
    with pytest.raises(SystemExit, match="usage"):
        bench_floor.main()


def test_floor_figure_gives_a_variant_row_a_legend_entry_of_its_own():
    """The real-rate lookahead row and its --variant twin are two lines: their legend labels differ."""
    from eval.plot import _floor_label

    base = "OasisKV lookahead @2048 (whole-step graph, torch.compile), real-model delta rate (5 blocks per (seq, head, "
    labels = {_floor_label(base + "layer-step))"),
              _floor_label(base + "job, one per 2 steps)) [every2: selection_interval=2 max_fetch_blocks=6]",
                           "every2")}
    assert labels == {"OasisKV lookahead @2048", "OasisKV lookahead @2048 [every2]"}
