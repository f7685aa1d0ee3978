"""Soak: many `generate` calls with a fresh OasisCache each, with and without `with` blocks, and what the process
holds as they accumulate: resident memory, live threads, open file descriptors, time per call.

    python -m eval.soak --calls 1000 --selectors lookahead current-query static --out eval/results/soak_cpu

Random-weight tiny Llama on the CPU (the bookkeeping of a cache, its worker thread and its host store are what is
measured, not speed). A cache that is dropped without `close()` must be freed, and its worker joined, when its last
reference goes; resident memory is read after `malloc_trim` where the C library has it. Prints a markdown table and
writes JSON (environment, config, command) and a figure next to it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import threading
import time
from pathlib import Path

import psutil
import torch

import oasis_hf
from eval._common import code_identity, finish, markdown_table
from eval._harness import TINY, build_model
from eval.plot import pyplot_or_none, result_path, save_figure
from oasis_hf import compat

logger = logging.getLogger("eval.soak")

COLUMNS = ["selector", "with block", "call", "RSS MiB", "threads", "fds", "ms/call"]


def trimmed_rss() -> int:
    """Resident bytes after returning freed heap pages to the OS (glibc's malloc_trim), where available."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return psutil.Process().memory_info().rss


def sample(selector: str, with_block: bool, call: int, seconds: float) -> dict:
    return {"selector": selector, "with block": with_block, "call": call, "RSS MiB": trimmed_rss() / 2**20,
            "threads": threading.active_count(), "fds": psutil.Process().num_fds(), "ms/call": seconds * 1e3}


@torch.inference_mode()
def soak(model, selector: str, with_block: bool, calls: int, marks: set[int], prompt: int, new_tokens: int):
    """Run `calls` generate calls; a sample after each call in `marks`."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=gen)
    config = oasis_hf.OasisConfig(block_size=16, sink_tokens=16, recent_tokens=32, budget_tokens=128,
                                  max_fetch_blocks=2, selector=selector)
    rows = []
    for call in range(1, calls + 1):
        t0 = time.perf_counter()
        if with_block:
            with oasis_hf.OasisCache(model.config, config) as cache:
                model.generate(ids, **{compat.cache_kwarg(model): cache}, max_new_tokens=new_tokens, do_sample=False)
        else:
            cache = oasis_hf.OasisCache(model.config, config)
            model.generate(ids, **{compat.cache_kwarg(model): cache}, max_new_tokens=new_tokens, do_sample=False)
            del cache
        if call in marks:
            rows.append(sample(selector, with_block, call, time.perf_counter() - t0))
            logger.info("%s with=%s call %d: %s", selector, with_block, call, rows[-1])
    return rows


def plot_soak(payload: dict, path: Path) -> Path | None:
    """Three panels against the call number: resident MiB, live threads, open descriptors; a line per selector and
    with/without `with` blocks."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    rows = payload["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = sorted({(r["selector"], r["with block"]) for r in rows})
    for ax, key in zip(axes, ("RSS MiB", "threads", "fds"), strict=True):
        for selector, with_block in series:
            pts = [(r["call"], r[key]) for r in rows if (r["selector"], r["with block"]) == (selector, with_block)]
            ax.plot(*zip(*pts, strict=True), "-" if with_block else "--", marker="o",
                    label=f"{selector}, {'with' if with_block else 'no with'}")
        ax.set_xscale("log")
        ax.set_xlabel("generate call")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    return save_figure(fig, plt, result_path(path, ".png"))


def main() -> None:
    code_identity()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--selectors", nargs="+", default=["lookahead", "current-query", "static"])
    parser.add_argument("--prompt", type=int, default=120, help="prompt tokens per call")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    model = oasis_hf.enable(build_model(TINY, "cpu", torch.float32))
    marks = {1, max(1, args.calls // 10), max(1, args.calls // 2), args.calls}
    rows = []
    for selector in args.selectors:
        for with_block in (True, False):
            gc.collect()
            rows.extend(soak(model, selector, with_block, args.calls, marks, args.prompt, args.new_tokens))
    table = (f"Soak: {args.calls} generate calls per row, a fresh OasisCache each (tiny Llama, CPU, prompt "
             f"{args.prompt}, {args.new_tokens} new tokens, budget 128); RSS after malloc_trim; pid {os.getpid()}\n\n"
             + markdown_table(rows, COLUMNS))
    finish(args, table, {"rows": rows}, plot_soak)


if __name__ == "__main__":
    main()
