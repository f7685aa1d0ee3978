"""eval.bench_multigpu's CPU smoke run: every row kind runs and the ratios are against dense graphed (the timings of
a tiny model on the CPU mean nothing; the benchmark measures on GPUs)."""

import json
import sys


def test_multigpu_bench_runs_every_kind_on_the_cpu(tmp_path, monkeypatch):
    from eval import bench_multigpu

    out = tmp_path / "multigpu"
    monkeypatch.setattr(sys, "argv", ["bench_multigpu", "--device", "cpu", "--contexts", "256", "--budget", "256",
                                      "--max-batch", "2", "--host-gib", "1", "--selectors", "lookahead",
                                      "--warmup", "1", "--repeats", "2", "--out", str(out)])
    bench_multigpu.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["kind"] for r in rows] == ["dense-eager", "dense-graphed", "oasis-lookahead"]
    assert all(r["tokens_per_s"] > 0 and r["context"] == 256 and r["batch"] == 2 for r in rows)
    graphed, oasis = rows[1], rows[2]
    assert graphed["max abs logit diff vs eager"] == 0.0 and graphed["tokens/s vs dense graphed"] == 1.0
    assert abs(oasis["tokens/s vs dense graphed"] - oasis["tokens/s"] / graphed["tokens/s"]) < 1e-9


def test_multigpu_bench_on_the_cpu_needs_a_batch(monkeypatch, capsys):
    import pytest

    from eval import bench_multigpu

    monkeypatch.setattr(sys, "argv", ["bench_multigpu", "--device", "cpu", "--host-gib", "1"])
    with pytest.raises(SystemExit):
        bench_multigpu.main()
    assert "--max-batch" in capsys.readouterr().err
