"""The benchmark figures draw from committed results (plumbing: files are written, skipped points tolerated)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="figures need matplotlib (pip install -e .[dev] installs it)")

from eval import plot  # noqa: E402
from eval.bench_sweep import plot_sweep  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "eval" / "results"


def test_sweep_figures_from_committed_results(tmp_path):
    payload = json.loads((RESULTS / "multigpu_8b_2gpu.json").read_text())
    payload["rows"].append({"method": "dense DynamicCache (sdpa)", "context": 262144, "batch": 64,
                            "skipped": "does not fit"})  # a skipped point has no timings
    made = plot_sweep(payload, tmp_path / "sweep")
    assert [p.name for p in made] == ["sweep_step_vs_context.png", "sweep_throughput_vs_batch.png",
                                      "sweep_gpu_kv_vs_context.png"]
    assert all(p.stat().st_size > 10_000 for p in made)


@pytest.mark.parametrize("name", ["multigpu_8b_2gpu", "capacity_24g_32k", "kernels_h200", "remote_8b_32k",
                                  "lookahead_decode_8b_b8_32k"])
def test_eval_plot_redraws_each_kind_of_result(tmp_path, name, capsys):
    copy = tmp_path / f"{name}.json"
    copy.write_text((RESULTS / f"{name}.json").read_text())
    plot.main([str(copy)])
    assert copy.with_suffix(".png").stat().st_size > 10_000, capsys.readouterr().out
