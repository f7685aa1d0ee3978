"""Shared helpers of the eval scripts: environment record, timing, markdown + JSON output."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def environment() -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # The host side of asynchronous work (thread hand-offs, launches) differs between machine runtimes, e.g. a
        # gVisor sandbox (reports kernel 4.4.0) against a microVM; the kernel release and CPU count tell them apart.
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "-m", "eval." + Path(sys.argv[0]).stem,
                                                      *sys.argv[1:]]),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["gpus"] = torch.cuda.device_count()
    env.update(code_identity())
    return env


@functools.cache
def code_identity() -> dict:
    """``git_sha``, ``sources_differ_from_git_sha`` and ``source_sha256`` of the code this process runs, taken once
    per process: every benchmark's `main` calls it before any work, so sources edited during a long run (another
    commit, a checkout) do not relabel what was measured (a long run would otherwise record a commit made after it
    had started)."""
    identity = git_identity(Path(__file__).resolve().parents[1])
    # A copy of the working tree (the GPU machine's) may carry stale git metadata or uncommitted changes: record what
    # actually ran. `python -m eval._common` prints the same hash for a checkout.
    identity["source_sha256"] = source_hash()
    return identity


def git_identity(root: Path) -> dict:
    """``git_sha`` (short) and ``sources_differ_from_git_sha`` of the sources under `root`: None and absent unless
    `root` is the top of a git checkout. A copy of the sources inside another checkout's ignored folder (an A/B tree)
    would otherwise be labelled with that checkout's commit, and its edits would not show as differences."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return {"git_sha": None}
        # Sources that differ from that commit (uncommitted edits, or a copied tree over stale git metadata, as on
        # the GPU machine): then git_sha does not name what ran, source_sha256 does.
        return {"git_sha": git("rev-parse", "--short", "HEAD"), "sources_differ_from_git_sha": bool(
            git("status", "--porcelain", "--", ":(glob)oasis_hf/**/*.py", ":(glob)eval/*.py"))}
    except (OSError, subprocess.CalledProcessError):
        return {"git_sha": None}


def source_hash() -> str:
    """sha256 (first 12 hex digits) of the Python sources of `oasis_hf/` and `eval/`, in path order."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.glob("oasis_hf/**/*.py"), *root.glob("eval/*.py")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def synchronize() -> None:
    """Wait for every visible GPU (a model split across GPUs ends a step on its last one)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def time_steps(step, warmup: int, repeats: int, enqueue_ms: list[float] | None = None) -> list[float]:
    """Milliseconds of each call of `step()` after `warmup` calls (device synchronised around each call).

    If `enqueue_ms` is given, the host time of each call before the closing synchronisation is appended to it: when
    it is close to the step time the step is bound by the CPU (Python, launches), when it is far below, by the GPU.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        if enqueue_ms is not None:
            enqueue_ms.append((t1 - t0) * 1e3)
    return times


def pipelined_ms(step, repeats: int) -> float:
    """Mean milliseconds per call of `step()` over `repeats` calls queued back to back with one synchronisation at
    the end: the step of a loop that never waits for the device. Against `time_steps` (synchronised around every
    call) the difference is the host work a loop that waits every step, such as transformers' ``generate``, cannot
    hide behind the GPU."""
    synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize()
    return (time.perf_counter() - t0) * 1e3 / repeats


#: The flag a benchmark's profiling child runs with (`profiles_from_child`); hidden from its --help.
PROFILE_CHILD_FLAG = "--profile-in-process"


def without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without the option `name` and its value (both spellings, ``NAME VALUE`` and ``NAME=VALUE``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out


def child_rows(module: str, argv: list[str], tmp: Path, extra: list[str]) -> list[dict]:
    """Run benchmark `module` in a child process with the parent's arguments `argv` followed by `extra` (a later
    option overrides an earlier one), its ``--out`` replaced by one under `tmp`; returns the rows of its JSON."""
    out = Path(tmp) / "child"
    subprocess.run([sys.executable, "-m", module, *without_option(argv, "--out"), *extra, "--out", str(out)],
                   check=True)
    return json.loads(result_path(out, ".json").read_text())["rows"]


def profiles_from_child(module: str, argv: list[str], tmp: Path) -> list[dict]:
    """Run benchmark `module` again in a child process that profiles, and return the rows of its JSON.

    A torch.profiler session leaves CUPTI attached to its process: every later launch there is slower (the host's
    work per graph replay of an OasisKV step grew from about 0.2 to 0.3-0.8 ms on the H200), so a process that
    profiles must not time anything after it. The parent times without profiling; the child gets the parent's
    arguments with `PROFILE_CHILD_FLAG` (`child_rows`); its timings are discarded, its profiles merged
    (`merge_profiles`)."""
    return child_rows(module, argv, tmp, [PROFILE_CHILD_FLAG])


def merge_profiles(rows: list[dict], profiled: list[dict], key=("method", "batch", "context")) -> int:
    """Copy each `profiled` row's ``"profile"`` into the row of `rows` with the same `key` fields; returns how many."""
    profiles = {tuple(r.get(k) for k in key): r["profile"] for r in profiled if "profile" in r}
    merged = 0
    for row in rows:
        profile = profiles.get(tuple(row.get(k) for k in key))
        if profile is not None:
            row["profile"] = profile
            row["profile process"] = "a separate process (torch.profiler slows later launches in its own)"
            merged += 1
    return merged


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for col in columns:
            value = row.get(col, "")
            cells.append(f"{value:.3g}" if isinstance(value, float) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def finish(args, table: str, payload: dict, plot=None) -> None:
    """Print the table; with ``--out``, write markdown + JSON (the run's arguments under ``"config"``, the
    environment under ``"env"``) and the figure ``plot(payload, path)`` draws."""
    print(table)
    if args.out is None:
        return
    payload = {"env": payload.pop("env", None) or environment(), "config": vars(args) | {"out": str(args.out)},
               **payload}
    write_results(args.out, payload, table)
    if plot is not None:
        plot(payload, args.out)


_RESULT_SUFFIXES = (".json", ".md", ".png")


def result_path(path: Path, ext: str) -> Path:
    """`path` with the result extension `ext`: a ``.json``/``.md``/``.png`` suffix is replaced, anything else is
    kept (``--out eval/results/accuracy_qwen_1.5b`` gives ``accuracy_qwen_1.5b.json``, not ``accuracy_qwen_1.json``)."""
    path = Path(path)
    if path.suffix in _RESULT_SUFFIXES:
        path = path.with_suffix("")
    return path.with_name(path.name + ext)


def write_results(path: Path, payload: dict, table: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(result_path(path, ".json"), json.dumps(payload, indent=2, default=str))
    _write_atomic(result_path(path, ".md"), table + "\n")


def _write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a run killed mid-write (a time limit) leaves the previous file
    whole, which ``--resume`` runs read back."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


if __name__ == "__main__":
    print(source_hash())


def config_fields(parser: argparse.ArgumentParser, pairs: list[str], budgets: list[int],
                  base: dict | None = None, rows: list[tuple[str, dict]] | None = None,
                  reserved: tuple[str, ...] = ("budget_tokens", "selector", "measure_recall")) -> dict:
    """``--config FIELD=VALUE ...`` as OasisConfig keyword arguments (ints, floats, true/false, none and JSON parsed),
    checked against `OasisConfig` at every budget (on top of `base`) for each of the rows that will run (`rows`:
    (selector, the row's own fields)) before any model is loaded. `reserved` fields are the script's to set (its
    rows or other flags): naming one is an error."""
    import oasis_hf

    names = {f.name for f in dataclasses.fields(oasis_hf.OasisConfig)}
    fields = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in names or name in reserved:
            parser.error(f"--config {pair!r}: write FIELD=VALUE with an OasisConfig field other than "
                         f"{', '.join(reserved)} (this script sets those); fields: {sorted(names - set(reserved))}")
        fields[name] = _value(text)
    for budget in budgets:
        for selector, own in rows or [("current-query", {})]:
            try:
                # As `run_row` merges them: a row's own fields win over --config, a variant's over both.
                merged = fields | own if base is None else base | own | fields
                oasis_hf.OasisConfig(budget_tokens=budget, selector=selector, **merged)
            except (TypeError, ValueError) as error:
                parser.error(f"--config at budget {budget} for the {selector} rows: {error}")
    return fields


def _value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    if text[:1] in "{[":  # a mapping or list, e.g. layer_budget_tokens={"0": 640}
        return json.loads(text)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
