"""Budgets of single layers (`OasisConfig.layer_budget_tokens`) and the recall measured per layer."""

import json

import pytest
import torch
from transformers import DynamicCache

import oasis_hf
from oasis_hf.errors import UnsupportedError
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded

SMALL = dict(budget_tokens=128, max_fetch_blocks=2)  # 8 slots of 16: 1 sink, 3 recent, 4 selected


def test_layer_budgets_are_normalised_and_survive_json():
    cfg = oasis_hf.OasisConfig(layer_budget_tokens={3: 4096, 0: 8192})
    assert cfg.layer_budget_tokens == ((0, 8192), (3, 4096))
    assert (cfg.layer_budget(0), cfg.layer_budget(3), cfg.layer_budget(1)) == (8192, 4096, 2048)
    assert cfg.layer_budget_blocks(0) == 8192 // cfg.block_size
    again = oasis_hf.OasisConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))  # keys become strings in JSON
    assert again == cfg
    assert oasis_hf.OasisConfig(layer_budget_tokens={}).layer_budget_tokens is None


@pytest.mark.parametrize("spec, why", [
    ({0: 100}, "multiple of block_size"),
    ({0: 64}, ">= sink_tokens"),
    ({-1: 2048}, "layer index"),
    ({True: 2048}, "layer index"),
    ([(0, 2048), (0, 4096)], "named twice"),
    (7, "dict"),
])
def test_invalid_layer_budgets_say_what_is_wrong(spec, why):
    with pytest.raises(ValueError, match="layer_budget_tokens") as info:
        oasis_hf.OasisConfig(layer_budget_tokens=spec)
    assert why in str(info.value)


def test_a_layer_the_cache_does_not_manage_is_refused():
    model = tiny_model("gemma3", attn="oasis")  # layers 0-2 sliding, layer 3 global
    with pytest.raises(UnsupportedError, match=r"layer\(s\) \[0\].*full-attention layers are \[3\]"):
        oasis_cache(model, layer_budget_tokens={0: 256})
    with pytest.raises(UnsupportedError, match=r"layer\(s\) \[9\]"):
        oasis_cache(tiny_model("llama", attn="oasis"), layer_budget_tokens={9: 256})


def test_each_layer_allocates_and_counts_its_own_budget():
    model = tiny_model("llama", layers=3, attn="oasis")
    ids, mask = left_padded([200])
    with oasis_cache(model, layer_budget_tokens={1: 256}, **SMALL) as cache:
        generate(model, ids, mask, cache)
        slots = [layer.pool_k.shape[2] for layer in cache.oasis_layers]
        assert slots == [8, 16, 8]
        assert [layer.table.num_slots for layer in cache.oasis_layers] == slots
        with oasis_cache(model, **SMALL) as uniform:
            generate(model, ids, mask, uniform)
            extra = cache.device_nbytes() - uniform.device_nbytes()
        layer = cache.oasis_layers[1]
        per_slot = 2 * layer.num_kv_heads * layer.pool_k.shape[3] * layer.head_dim * layer.pool_k.element_size()
        # 8 more slots per KV head in layer 1: their K/V, plus the larger tables of that layer (slot entries; its
        # block map addresses at least the budget's blocks), a few hundred bytes here.
        assert 0 < extra - 8 * per_slot < per_slot
        for layer in cache.oasis_layers:
            layer.table.check()


@pytest.mark.parametrize("selector", ["lookahead", "current-query"])
def test_a_layer_whose_budget_covers_the_context_is_exact(selector):
    """Every layer small except through `layer_budget_tokens`: with all layers covered the tokens are dense's (the
    per-layer budget is what the step uses), and the recall per layer shows the covered layer exact."""
    ids, mask = left_padded([230, 170])
    dense = tiny_model("llama", layers=3)
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    model = tiny_model("llama", layers=3, attn="oasis")
    covered = {i: 512 for i in range(3)}
    with oasis_cache(model, selector=selector, layer_budget_tokens=covered, **SMALL) as cache:
        assert torch.equal(generate(model, ids, mask, cache), ref)
    with oasis_cache(model, selector=selector, **SMALL) as cache:
        assert not torch.equal(generate(model, ids, mask, cache), ref)  # the small budget alone is not exact here
    with oasis_cache(model, selector=selector, measure_recall=True, layer_budget_tokens={1: 512}, **SMALL) as cache:
        generate(model, ids, mask, cache)
        stats = cache.stats.summary()
    mass, topk = stats["layer_mass_recall"], stats["layer_topk_recall"]
    assert sorted(mass) == [0, 1, 2]
    assert mass[1] == pytest.approx(1.0) and topk[1] == pytest.approx(1.0)
    assert mass[0] < 0.999 and mass[2] < 0.999
    assert stats["mass_recall"] == pytest.approx(sum(mass.values()) / 3)  # every layer measured equally often
