"""Per-layer GPU budgets at a fixed total, from the attention mass each layer keeps at a few uniform budgets.

    python -m eval.recall --model qwen2.5-coder-0.5b-instruct --context 4096 --budgets 160 320 640 --trials 3 \
        --new-tokens 24 --loops prompt-lookup --methods 'lookahead, mean+minmax' --out /tmp/calib ...
    python -m eval.layer_budgets /tmp/calib.json --budget 320 --block-size 16 --out /tmp/layer_budgets_320

Layers are not equally sparse: in the measured runs the first and last layers of a model keep much less of their
attention on the same number of resident blocks than the middle ones. A calibration run of `eval.recall` (any
prompts; the pass-key prompts by default, not the suite being evaluated) gives each layer's attention mass on the
resident blocks at several uniform budgets. Between two measured budgets a layer's mass is taken as linear in its
budget; starting from the smallest measured budget everywhere, the script adds one block at a time to the layer
whose mass grows most per block, until the layers' budgets sum to ``--budget`` times the number of layers, so the
GPU holds exactly what the uniform budget holds. No layer goes beyond the largest measured budget (nothing is
extrapolated). The output is the ``layer_budget_tokens`` of `oasis_hf.OasisConfig` (layers at ``--budget`` left
out), with the mass each layer is predicted to keep, as a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from eval._common import code_identity, finish, markdown_table

logger = logging.getLogger("eval.layer_budgets")


def mass_curves(rows: list[dict], method: str | None = None,
                decoding: str | None = None) -> dict[int, dict[int, float]]:
    """``{layer: {budget: attention mass on resident}}`` from `eval.recall` rows of one method and decoding loop
    (each budget measured once; with `method` / `decoding` None the rows must hold a single one)."""
    chosen = [r for r in rows if r.get("layer mass") and (method is None or r["method"] == method)
              and (decoding is None or r["decoding"] == decoding)]
    kinds = {(r["method"], r["decoding"]) for r in chosen}
    if len(kinds) != 1:
        raise ValueError(f"the rows hold {sorted(kinds) or 'no measured method'}; pick one with --method and "
                         "--decoding (rows without per-layer masses come from a run before they were recorded)")
    budgets = [int(r["budget"]) for r in chosen]
    if len(set(budgets)) != len(budgets) or len(budgets) < 2:
        raise ValueError(f"need each budget once and at least two budgets, got {sorted(budgets)}")
    curves: dict[int, dict[int, float]] = {}
    for row in chosen:
        for layer, mass in row["layer mass"].items():
            curves.setdefault(int(layer), {})[int(row["budget"])] = float(mass)
    incomplete = [layer for layer, curve in curves.items() if len(curve) != len(budgets)]
    if incomplete:
        raise ValueError(f"layers {incomplete} were not measured at every budget {sorted(budgets)}")
    return dict(sorted(curves.items()))


def predicted(curve: dict[int, float], budget: int) -> float:
    """The mass of `curve` (budget -> mass) at `budget`, linear between measured budgets (within their range)."""
    points = sorted(curve.items())
    if not points[0][0] <= budget <= points[-1][0]:
        raise ValueError(f"budget {budget} lies outside the measured {points[0][0]}..{points[-1][0]}")
    (b0, m0), (b1, m1) = next((p, q) for p, q in zip(points, points[1:], strict=False) if budget <= q[0])
    return m0 + (m1 - m0) * (budget - b0) / (b1 - b0)


def allocate(curves: dict[int, dict[int, float]], budget: int, block_size: int, low: int | None = None,
             high: int | None = None) -> dict[int, int]:
    """Per-layer budgets (tokens, multiples of `block_size`) summing to ``budget * len(curves)``: greedy, one block
    at a time to the layer with the largest predicted gain in mass (ties: the lower layer), each layer between `low`
    and `high` (default: the smallest and largest measured budgets)."""
    measured = (max(min(c) for c in curves.values()), min(max(c) for c in curves.values()))
    low = measured[0] if low is None else low
    high = measured[1] if high is None else high
    if not measured[0] <= low <= high <= measured[1] or low % block_size or high % block_size:
        raise ValueError(f"the bounds {low}..{high} must be multiples of the block size {block_size} within the "
                         f"measured budgets {measured[0]}..{measured[1]}")
    if budget % block_size or not low <= budget <= high:
        raise ValueError(f"--budget {budget} must be a multiple of the block size {block_size} within the bounds "
                         f"{low}..{high}")
    out = {layer: low for layer in curves}
    spare = (budget - low) * len(curves)
    while spare > 0:
        gains = {layer: predicted(curve, out[layer] + block_size) - predicted(curve, out[layer])
                 for layer, curve in curves.items() if out[layer] + block_size <= high}
        best = max(gains, key=lambda layer: (gains[layer], -layer))
        out[best] += block_size
        spare -= block_size
    return out


def main() -> None:
    code_identity()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("calibration", type=Path, help="an eval.recall JSON with rows at two or more budgets")
    parser.add_argument("--budget", type=int, required=True, help="the uniform budget whose total is redistributed")
    parser.add_argument("--block-size", type=int, required=True, help="OasisConfig.block_size of the run")
    parser.add_argument("--low", type=int, default=None,
                        help="no layer below this budget (default: the smallest measured budget)")
    parser.add_argument("--high", type=int, default=None,
                        help="no layer above this budget (default: the largest measured budget)")
    parser.add_argument("--method", default=None, help="the eval.recall row label to use (default: the only one)")
    parser.add_argument("--decoding", default=None, help="the eval.recall decoding loop (default: the only one)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    calibration = json.loads(args.calibration.read_text())
    try:
        curves = mass_curves(calibration["rows"], args.method, args.decoding)
        budgets = allocate(curves, args.budget, args.block_size, args.low, args.high)
    except ValueError as error:
        parser.error(str(error))
    rows = [{"layer": layer, "budget": budgets[layer], "mass at uniform": predicted(curve, args.budget),
             "predicted mass": predicted(curve, budgets[layer])} for layer, curve in curves.items()]
    uniform = sum(r["mass at uniform"] for r in rows) / len(rows)
    ours = sum(r["predicted mass"] for r in rows) / len(rows)
    layer_budget_tokens = {layer: b for layer, b in budgets.items() if b != args.budget}
    bounds = f", each within {args.low or 'measured'}..{args.high or 'measured'}" if args.low or args.high else ""
    table = (f"Per-layer budgets at {args.budget} tokens per layer on average (total {args.budget * len(rows)})"
             f"{bounds}, from `{args.calibration}`: mean mass {uniform:.4f} uniform, {ours:.4f} predicted.\n\n"
             f"`layer_budget_tokens={json.dumps(layer_budget_tokens)}`\n\n"
             + markdown_table(rows, ["layer", "budget", "mass at uniform", "predicted mass"]))
    finish(args, table, {"calibration": str(args.calibration), "calibration_env": calibration.get("env"),
                         "layer_budget_tokens": layer_budget_tokens, "mean_mass_uniform": uniform,
                         "mean_mass_predicted": ours, "rows": rows})


if __name__ == "__main__":
    main()
