"""Host cost of handing a decode step's selection jobs to the prefetch worker thread (no GPU needed).

    python -m eval.bench_handoff --out eval/results/handoff_cpu

The lookahead decode step on the H200 was bound by host time, and by 1.7x more on one machine than on another, while
the synchronous rows agreed within 2%. This isolates the host side of the pattern: a "step" of ``--layers`` layers,
each doing ``--layer-us`` of Python work (the model's forward code), waiting for its previous job, then submitting a
new one to an `oasis_hf.cache.prefetch.Prefetcher`. Each job does ``--job-us`` of Python work around one call that
releases the GIL (a CUDA graph replay does). Rows: no jobs, jobs run inline, jobs through the worker thread. The
ratio of the thread row to the inline row is the price of the hand-off on this machine; run it on each machine whose
GPU results differ (it records the kernel release, which tells a gVisor sandbox, 4.4.0, from a microVM).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from eval._common import code_identity, environment, finish, markdown_table, median
from oasis_hf.cache.prefetch import Prefetcher

logger = logging.getLogger("eval.bench_handoff")


def busy(us: float) -> None:
    """Hold the GIL doing Python work for about `us` microseconds."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def job(us: float):
    def run() -> None:
        busy(us / 2)
        time.sleep(0)  # releases and retakes the GIL, as a graph replay does
        busy(us / 2)

    return run


def step_time(mode: str, layers: int, layer_us: float, job_us: float, steps: int) -> list[float]:
    """Milliseconds per step of `steps` steps (after 3 warm-up steps) in `mode`: none, inline or thread."""
    times = []
    with Prefetcher(torch.device("cpu"), name="handoff-bench") as worker:
        tickets = [None] * layers
        for i in range(steps + 3):
            t0 = time.perf_counter()
            for layer in range(layers):
                if tickets[layer] is not None:
                    worker.wait(tickets[layer])
                    tickets[layer] = None
                busy(layer_us)
                if mode == "inline":
                    job(job_us)()
                elif mode == "thread":
                    tickets[layer] = worker.submit(job(job_us))
            if i >= 3:
                times.append((time.perf_counter() - t0) * 1e3)
        for ticket in tickets:
            if ticket is not None:
                worker.wait(ticket)
    return times


def main() -> None:
    code_identity()  # the code that runs, pinned before any work
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--layer-us", type=float, default=600.0, help="Python work per layer (the forward's code)")
    parser.add_argument("--job-us", type=float, default=60.0, help="Python work per job around its replay")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for mode in ("none", "inline", "thread"):
        times = step_time(mode, args.layers, args.layer_us, args.job_us, args.steps)
        rows.append({"jobs": mode, "ms/step (median)": median(times), "ms/step (max)": max(times)})
    base = rows[0]["ms/step (median)"]
    inline = rows[1]["ms/step (median)"]
    for row in rows:
        row["vs no jobs"] = row["ms/step (median)"] / base
        row["vs inline"] = row["ms/step (median)"] / inline
    env = environment()
    header = (f"Test configuration: kernel {env['kernel']}, {env['cpus']} CPUs, Python {env['python']}; {args.layers} "
              f"layers x {args.layer_us:.0f} us of Python, jobs of {args.job_us:.0f} us around a GIL release; "
              f"`{env['command']}`\n\n")
    table = header + markdown_table(rows, ["jobs", "ms/step (median)", "ms/step (max)", "vs no jobs", "vs inline"])
    finish(args, table, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
