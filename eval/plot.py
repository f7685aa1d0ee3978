"""PNG figures for benchmark results: ``python -m eval.plot eval/results/kernels_h200.json [...]``.

`bench_decode` calls `plot_decode` itself when matplotlib is installed (``pip install oasis_hf[eval]``); this entry
point redraws figures from committed JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eval._common import result_path


def plot_decode(payload: dict, path: Path) -> Path | None:
    """Two panels per run: decode step time per method (dense dashed) and KV bytes per sequence on the GPU."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in payload["rows"] if "error" not in r]  # a failed method is in the table, not the figure
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
    return save_figure(fig, plt, result_path(path, ".png"))


def plot_vs_budget(rows: list[dict], value: str, path: Path, ylabel: str, title: str,
                   panel: str | None = None) -> Path | None:
    """`value` against ``row["budget"]`` (log2 axis), one line per ``row["method"]``; a method whose budget is
    ``"full"`` (dense) is drawn as a dashed horizontal line. With `panel` (a row key such as ``"length"``), one panel
    per value of that key, side by side. PNG next to `path`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if isinstance(r.get(value), (int, float))]  # "no decode step" and the like: not drawn
    panels = sorted({r.get(panel) for r in rows}, key=lambda v: (v is None, v or 0)) if panel else [None]
    panels = panels or [None]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 if len(panels) == 1 else 4.6 * len(panels) + 3.4, 4.2),
                             sharex=True, sharey=True, squeeze=False)
    # One colour per method across the panels, and one legend with every method of any panel.
    colours = {m: f"C{i % 10}" for i, m in enumerate(dict.fromkeys(r["method"] for r in rows if r["budget"] != "full"))}
    legend: dict[str, object] = {}
    for ax, key in zip(axes[0], panels, strict=True):
        shown = [r for r in rows if panel is None or r.get(panel) == key]
        for method in dict.fromkeys(r["method"] for r in shown):
            points = sorted((r["budget"], r[value]) for r in shown if r["method"] == method and r["budget"] != "full")
            full = [r[value] for r in shown if r["method"] == method and r["budget"] == "full"]
            if full:
                line = ax.axhline(full[0], ls="--", c="k", lw=1)
                legend.setdefault(f"{method} (full KV)", line)
            if points:
                (line,) = ax.plot(*zip(*points, strict=True), marker="o", c=colours[method])
                legend.setdefault(method, line)
        ax.set_xscale("log", base=2)
        ax.set_title(title if panel is None else f"{panel} {key if key is not None else '(not recorded)'}",
                     fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    xlabel = "budget (tokens per sequence, KV head and layer)"
    if len(panels) == 1:
        axes[0][0].set_xlabel(xlabel)
    else:  # once under the panels
        fig.supxlabel(xlabel, fontsize=10)
    if panel is not None:
        fig.suptitle(title, fontsize=10)
    if legend:  # beside the panels when there are several, so that it hides no line
        where = {} if len(panels) == 1 else {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0)}
        axes[0][-1].legend(list(legend.values()), list(legend), fontsize=8, **where)
    return save_figure(fig, plt, result_path(path, ".png"))


def save_figure(fig, plt, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def pyplot_or_none():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_throughput(payload: dict, path: Path) -> Path | None:
    """Decode tokens/s per method at each context (grouped bars, log scale), each bar labelled with its batch and
    its ratio to dense (graphed where the run has that row): for `bench_multigpu` and `bench_capacity`, where every
    method runs at its own batch."""
    plt = pyplot_or_none()
    rows = [r for r in payload["rows"] if "tokens/s" in r]
    if plt is None or not rows:
        return None
    contexts = sorted({r["context"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, method in enumerate(methods):
        for j, context in enumerate(contexts):
            row = next((r for r in rows if r["method"] == method and r["context"] == context), None)
            if row is None:
                continue
            x = j + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, row["tokens/s"], width, color="#888" if method.startswith("dense") else "#2a7",
                   label=method if j == 0 else None)
            ratio = row.get("tokens/s vs dense graphed", row.get("tokens/s vs dense"))  # the strongest dense row
            note = f"B={row['batch']}" + (f"\n{ratio:.2f}x" if ratio and not method.startswith("dense") else "")
            ax.text(x, row["tokens/s"], note, ha="center", va="bottom", fontsize=7)
    ax.set_ylim(top=max(r["tokens/s"] for r in rows) * 2)  # room for the labels
    ax.set_xticks(range(len(contexts)), [f"{c // 1024}k" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_yscale("log")
    env = payload.get("env", {})
    ax.set_title(f"{env.get('gpus', 1)} x {env.get('gpu', 'cpu')}: largest batch per method", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, plt, result_path(path, ".png"))


def plot_kernels(payload: dict, path: Path) -> Path | None:
    """Achieved GB/s of the sparse attention kernel against batch, one line per (budget, T), and the measured
    device-copy bandwidth (dashed)."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for budget, tokens in dict.fromkeys((r["budget"], r["T"]) for r in rows):
        pts = sorted((r["batch"], r["GB/s"]) for r in rows if r["budget"] == budget and r["T"] == tokens)
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"budget {budget}, T={tokens}")
    ax.axhline(payload["copy GB/s"], ls="--", c="k", lw=1, label="device copy (read + write)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("GB/s of K/V read")
    ax.set_title(f"sparse_attention, {payload.get('env', {}).get('gpu')}, Llama-8B heads", fontsize=10)
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    return save_figure(fig, plt, result_path(path, ".png"))


def plot_remote_memory(payload: dict, path: Path) -> Path | None:
    """GPU KV and host memory per sequence of the three decode-node kinds of `bench_remote` (log scale)."""
    plt = pyplot_or_none()
    if plt is None or "memory" not in payload:
        return None
    rows = payload["memory"]
    names = [r["decode node"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [max(r["GPU KV MiB/seq"], 1e-3) for r in rows], 0.4, label="GPU KV", color="#47a")
    ax.barh([i + 0.2 for i in y], [max(r["host MiB/seq"], 1e-3) for r in rows], 0.4, label="host", color="#c84")
    ax.set_yticks(list(y), names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(left=1)
    ax.set_xlabel("MiB per sequence (log scale)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    return save_figure(fig, plt, result_path(path, ".png"))


def plot_e2e(payload: dict, path: Path) -> Path | None:
    """New tokens/s of each end-to-end method, grouped by batch size (rows that failed, or that carry an ``invalid``
    reason, are left out)."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = [r for r in payload["rows"] if isinstance(r.get("new tokens/s"), (int, float)) and "invalid" not in r]
    batches = sorted({r["batch"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = {r["batch"]: r["new tokens/s"] for r in rows if r["method"] == method}
        xs = [j + i * width for j, b in enumerate(batches) if b in values]
        ax.bar(xs, [values[b] for b in batches if b in values], width, label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("new tokens/s (whole batch)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return save_figure(fig, plt, result_path(path, ".png"))


def plot_accuracy(payload: dict, path: Path) -> Path | None:
    """Suite average against the budget, one panel per context length and one line per method (complete rows only:
    a mean over other lengths would compare methods measured at different lengths); dense as a horizontal line."""
    rows = [r for r in payload["rows"] if "average" in r]
    return plot_vs_budget(rows, "average", path, "suite average (0-100)", f"{payload['config']['model']}",
                          panel="length")


def plot_recall(payload: dict, path: Path) -> Path | None:
    """Attention mass on resident blocks against the budget, one line per method (PNG next to the table)."""
    rows = [row | {"method": f"{row['method']} [{row.get('decoding', 'greedy')}]"} for row in payload["rows"]]
    return plot_vs_budget(rows, "attention mass on resident", path,
                          "exact attention mass on resident blocks",
                          f"{payload['args']['model']}, ~{payload['args']['context']}-token "
                          f"{payload['args'].get('task') or 'pass-key'} prompts")


def _floor_label(method: str, variant: str = "") -> str:
    """A legend label: the method without the decode-path note (and the real-rate row without its cap, but with its
    ``--variant`` name: two rows, two lines)."""
    method = method.replace(" (whole-step graph)", "").replace(" (+ mean-key summaries read once)", "")
    if "real-model" not in method:
        return method
    return method.split(" (")[0] + (f" [{variant}]" if variant else "")


def plot_floor(payload: dict, path: Path) -> Path | None:
    """Two panels: ms/step against batch at the most common context, and against context at batch 1; one line per
    method, the same colour in both panels (dense dashed, floors dotted)."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = [r for r in payload["rows"] if "ms_per_step" in r and r.get("kind") != "dense-compile"]
    if not rows:
        return None
    contexts = [r["context"] for r in rows]
    # The batch panel's context: the one with the most batches, then one with a batch other than 1 (batch 1 has the
    # context panel), then the most rows.
    batches = {c: {r["batch"] for r in rows if r["context"] == c} for c in set(contexts)}
    common = max(batches, key=lambda c: (len(batches[c]), batches[c] != {1}, contexts.count(c)))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    variants = {r["method"]: r.get("variant", "") for r in rows}
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    panels = [(axes[0], "batch", lambda r: r["context"] == common, f"context {common}"),
              (axes[1], "context", lambda r: r["batch"] == 1, "batch 1")]
    for ax, x_key, keep, title in panels:
        for method in methods:
            pts = sorted((r[x_key], r["ms_per_step"]) for r in rows if r["method"] == method and keep(r))
            if not pts:
                continue
            style = ":" if method.startswith("floor") else ("--" if method.startswith("dense") else "-")
            ax.plot(*zip(*pts, strict=True), style, marker="o", color=colours[method],
                    label=_floor_label(method, variants[method]))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x_key)
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title(f"{payload['env'].get('gpu')}, {title}", fontsize=9)
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    axes[1].legend(list(handles.values()), list(handles), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_figure(fig, plt, result_path(path, ".png"))


def main(argv: list[str] | None = None) -> None:
    """Redraw the figure of each results JSON given, by the kind of run it holds."""
    for name in argv if argv is not None else sys.argv[1:]:
        path = Path(name)
        payload = json.loads(path.read_text())
        rows = payload.get("rows", [])
        first = rows[0] if rows else {}
        if "memory" in payload:
            print(plot_remote_memory(payload, path))
        elif "copy GB/s" in payload:
            print(plot_kernels(payload, path))
        elif "average" in first:
            print(plot_accuracy(payload, path))
        elif "attention mass on resident" in first:
            print(plot_recall(payload, path))
        elif "new tokens/s" in first:
            print(plot_e2e(payload, path))
        elif "hbm_bytes_per_s" in payload or payload.get("bench") == "eval.bench_floor":  # a run, or combined
            print(plot_floor(payload, path))
        elif "ms/step (median)" in first and "preset" in payload:
            print(plot_decode(payload, path))
        elif "context" in first:
            print(plot_throughput(payload, path))
        else:
            print(f"{path}: no figure for this kind of result")


if __name__ == "__main__":
    main()
