"""`eval.layer_budgets`: per-layer budgets at a fixed total from an `eval.recall` calibration run."""

import json
import sys

import pytest

from eval import layer_budgets


def rows(masses: dict[int, list[float]], budgets=(160, 320, 640), method="lookahead", decoding="greedy") -> list:
    return [{"method": method, "decoding": decoding, "budget": b,
             "layer mass": {str(layer): m[i] for layer, m in masses.items()}} for i, b in enumerate(budgets)]


def test_the_budget_moves_to_the_layers_that_gain_most_and_the_total_stays():
    # Layer 0 diffuse (gains a lot per block), layer 2 saturated (nothing to gain), layer 1 in between.
    curves = layer_budgets.mass_curves(rows({0: [0.5, 0.7, 0.9], 1: [0.8, 0.95, 0.97], 2: [0.99, 0.99, 0.99]}))
    out = layer_budgets.allocate(curves, 320, 16)
    # Per token: layer 0 gains 1.25e-3 up to 320 and 6.3e-4 beyond, layer 1 9.4e-4 then 6e-5, layer 2 nothing. The
    # 480 spare tokens: layer 0 to 320, layer 1 to 320, layer 0 to 480; the saturated layer keeps the minimum.
    assert out == {0: 480, 1: 320, 2: 160}
    # Bounds keep every layer near the uniform budget: the same order of preference, at most 400 and at least 256.
    assert layer_budgets.allocate(curves, 320, 16, low=256, high=400) == {0: 384, 1: 320, 2: 256}
    with pytest.raises(ValueError, match="bounds"):
        layer_budgets.allocate(curves, 320, 16, low=100)
    # The prediction never falls: each block went where it raised the mean mass most.
    before = sum(layer_budgets.predicted(c, 320) for c in curves.values())
    after = sum(layer_budgets.predicted(c, out[layer]) for layer, c in curves.items())
    assert after > before
    # Identical layers keep the uniform budget (ties broken by layer order, the total exact).
    same = layer_budgets.allocate(layer_budgets.mass_curves(rows({0: [0.5, 0.7, 0.8], 1: [0.5, 0.7, 0.8]})), 320, 16)
    assert same == {0: 320, 1: 320}


def test_linear_between_measured_budgets_and_nothing_extrapolated():
    curve = {160: 0.5, 320: 0.7, 640: 0.9}
    assert layer_budgets.predicted(curve, 240) == pytest.approx(0.6)
    assert layer_budgets.predicted(curve, 640) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="outside"):
        layer_budgets.predicted(curve, 656)
    curves = layer_budgets.mass_curves(rows({0: [0.5, 0.7, 0.9]}))
    for bad in (100, 328, 700):
        with pytest.raises(ValueError, match="--budget"):
            layer_budgets.allocate(curves, bad, 16)


def test_calibration_rows_must_be_one_method_at_several_budgets():
    both = rows({0: [0.5, 0.7, 0.9]}) + rows({0: [0.4, 0.6, 0.8]}, method="current-query")
    with pytest.raises(ValueError, match="--method"):
        layer_budgets.mass_curves(both)
    assert layer_budgets.mass_curves(both, method="current-query")[0][160] == 0.4
    with pytest.raises(ValueError, match="at least two budgets"):
        layer_budgets.mass_curves(rows({0: [0.5]}, budgets=(160,)))
    with pytest.raises(ValueError, match="no measured method"):
        layer_budgets.mass_curves([{"method": "lookahead", "decoding": "greedy", "budget": 160}])


def test_the_script_writes_the_config_field_and_the_prediction(tmp_path, monkeypatch):
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps({"env": {"torch": "x"}, "rows": rows({0: [0.5, 0.7, 0.9], 1: [0.99] * 3})}))
    out = tmp_path / "budgets"
    monkeypatch.setattr(sys, "argv", ["eval.layer_budgets", str(calibration), "--budget", "320", "--block-size", "16",
                                      "--out", str(out)])
    layer_budgets.main()
    payload = json.loads(out.with_suffix(".json").read_text())
    assert payload["layer_budget_tokens"] == {"0": 480, "1": 160}
    assert payload["mean_mass_predicted"] > payload["mean_mass_uniform"]
    import oasis_hf

    cfg = oasis_hf.OasisConfig(block_size=16, sink_tokens=16, recent_tokens=64, budget_tokens=320,
                               layer_budget_tokens=payload["layer_budget_tokens"])
    assert cfg.layer_budget_tokens == ((0, 480), (1, 160))
    assert 'layer_budget_tokens={"0": 480, "1": 160}' in out.with_suffix(".md").read_text()
