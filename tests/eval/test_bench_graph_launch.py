"""`eval.bench_graph_launch`: refuses what it cannot measure with a clear message; on CUDA every variant's graph
is captured and replays its whole work (the side branches joined), and gets its rows in both orders."""

import json

import pytest
import torch

from eval import bench_graph_launch


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be >= 1"),
    (["--side-kernels", "0"], "--side-kernels must be >= 1"),
    (["--variants", "no such variant"], "invalid choice"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_graph_launch.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit):
        bench_graph_launch.main(["--layers", "1"])
    assert "need a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
def test_every_variant_replays_and_writes_its_rows(tmp_path):
    out = tmp_path / "launch"
    bench_graph_launch.main(["--layers", "3", "--kernels", "2", "--rounds", "2", "--warmup", "2", "--repeats", "5",
                             "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [row["variant"] for row in rows[: len(bench_graph_launch.VARIANTS)]] == list(bench_graph_launch.VARIANTS)
    assert len(rows) == 2 * len(bench_graph_launch.VARIANTS)
    for row in rows:
        assert 0 < row["host us (replay call)"] <= row["synchronised us"]
        assert row["queued us"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(bench_graph_launch.VARIANTS))
def test_each_variant_runs_all_its_kernels(variant):
    graph, (x, y, z) = bench_graph_launch.build(variant, layers=3, kernels=2, side_kernels=2,
                                                device=torch.device("cuda"))
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 4 * 3 * 2) and torch.all(y == 4 * 3 * 2)
    assert torch.all(z == (4 * 3 if variant == "two-side-high" else 0))
