"""PNG figures for benchmark results: ``python -m eval.plot eval/results/core_decode_8b_b8_32k.json [...]``.

`bench_decode` calls `plot_decode` itself when matplotlib is installed (``pip install oasis_hf[eval]``); this entry
point redraws figures from committed JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_decode(payload: dict, path: Path) -> Path | None:
    """Two panels per run: decode step time per method (dense dashed) and KV bytes per sequence on the GPU."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = payload["rows"]
    names = [r["method"].replace(" (sdpa)", "").replace("DynamicCache", "DC") for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.55 * len(rows) + 2.2), sharey=True)
    ms = [r["ms/step (median)"] for r in rows]
    ax1.barh(names, ms, color=["#888" if "OasisKV" not in n else "#2a7" for n in names])
    ax1.axvline(ms[0], ls="--", c="k", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("ms per decode step (median, log scale; dashed: dense)")
    for y, value in enumerate(ms):
        ax1.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    kv = [r["GPU KV MiB/seq"] for r in rows]
    ax2.barh(names, kv, color="#47a")
    ax2.set_xlabel("KV on the GPU per sequence, MiB (pool + summaries + tables)")
    for y, value in enumerate(kv):
        ax2.text(value, y, f" {value:.0f}", va="center", fontsize=8)
    ax1.invert_yaxis()
    env, cfg = payload.get("env", {}), payload.get("config", {})
    fig.suptitle(f"{env.get('gpu', 'cpu')}: batch {cfg.get('batch')}, context {cfg.get('context')}, "
                 f"budget {cfg.get('budget')} ({payload.get('preset')})", fontsize=10)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_vs_budget(rows: list[dict], value: str, path: Path, ylabel: str, title: str) -> Path | None:
    """`value` against ``row["budget"]`` (log2 axis), one line per ``row["method"]``; a method whose budget is
    ``"full"`` (dense) is drawn as a dashed horizontal line. PNG next to `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = [(r["budget"], r[value]) for r in rows if r["method"] == method]
        if points[0][0] == "full":
            ax.axhline(points[0][1], ls="--", c="k", lw=1, label=f"{method} (full KV)")
        else:
            ax.plot(*zip(*points, strict=True), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens per sequence, KV head and layer)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    for name in argv if argv is not None else sys.argv[1:]:
        path = Path(name)
        print(plot_decode(json.loads(path.read_text()), path))


if __name__ == "__main__":
    main()
