"""`eval.delta_rate`: the blocks a real model's lookahead moves, per forward and per selection job."""

import pytest
import torch

import oasis_hf
from eval.delta_rate import measure
from tests._factories import VOCAB, tiny_model


@pytest.mark.parametrize("interval", [1, 2])
def test_delta_rate_counts_forwards_jobs_and_the_blocks_each_moves(interval):
    """With a job after every Nth forward, a layer runs one job per N forwards (the first forward has one), and the
    blocks per job are every block moved over the number of jobs."""
    model = tiny_model("llama", attn="oasis")
    ids = torch.randint(3, VOCAB, (1, 300), generator=torch.Generator().manual_seed(1))
    config = oasis_hf.OasisConfig(block_size=16, sink_tokens=16, recent_tokens=32, budget_tokens=128,
                                  selector="lookahead", selection_interval=interval, prefetch=False)
    row = measure(model, None, ids, config, new_tokens=9, drafted=False)
    assert row["forwards"] == 8  # the first new token comes from the prefill
    assert row["jobs"] == -(-8 // interval)
    assert row["blocks/(seq, head, forward)"] > 0  # random attention moves blocks
    moved = row["blocks/(seq, head, forward)"] * row["forwards"]
    assert row["blocks/(seq, head, job)"] == pytest.approx(moved / row["jobs"])


def test_delta_rate_refuses_a_bad_config_before_loading_a_model(monkeypatch, capsys):
    """`--config` is checked against OasisConfig before any model loads; the fields the script sets are refused."""
    import sys

    from eval import delta_rate

    monkeypatch.setattr(delta_rate.models, "load", lambda *a, **k: pytest.fail("loaded a model"))
    for pair, why in (("keep_margin=-1", "keep_margin"), ("selection_interval=2", "this script sets")):
        monkeypatch.setattr(sys, "argv", ["delta_rate", "--config", pair, "--device", "cpu"])
        with pytest.raises(SystemExit):
            delta_rate.main()
        assert why in capsys.readouterr().err
