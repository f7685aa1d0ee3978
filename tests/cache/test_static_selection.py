"""The ``static`` selector (StreamingLLM): sinks plus the latest blocks, kept without a selection in the step."""

import pytest
import torch

from oasis_hf.cache import scoring
from tests._factories import VOCAB, oasis_cache, tiny_model

BS, SLOTS = 16, 8  # blocks of 16 tokens, 8 slots: 1 sink block, 7 latest (2 of them the recent window)


def assert_sinks_and_latest(cache, mask: torch.Tensor) -> None:
    """Every layer holds exactly the sink block and the latest blocks of each sequence, with the host's K/V."""
    for layer in cache.layers:
        keys = cache.host.read_keys(layer.layer_idx, layer.length)
        num_blocks = -(-layer.length // BS)
        for b in range(mask.shape[0]):
            first_real = int(layer.kv_start[b]) // BS
            latest = list(range(first_real + 1, num_blocks))[-(SLOTS - 1):]
            expected = sorted({first_real, *latest})
            for h in range(layer.num_kv_heads):
                resident = layer.table.slot_block[b, h, :SLOTS].tolist()
                assert sorted(blk for blk in resident if blk >= 0) == expected, (layer.layer_idx, b, h, layer.length)
                for slot, blk in enumerate(resident):
                    if blk < 0:
                        continue
                    rows = torch.arange(blk * BS, min((blk + 1) * BS, layer.length))
                    rows = rows[rows >= int(layer.kv_start[b])]
                    held = layer.pool_k[b, h, slot, rows - blk * BS]
                    torch.testing.assert_close(held, keys[b, h, rows].to(held.dtype), atol=0, rtol=0)


def _prefilled(family: str, monkeypatch):
    """A tiny model, two left-padded sequences of 400 tokens, a static cache holding their first 200, and the list
    every later selection plan is counted in."""
    model = tiny_model(family, attn="oasis")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, 400), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    cache = oasis_cache(model, selector="static", budget_tokens=SLOTS * BS, max_fetch_blocks=None)
    with torch.no_grad():
        model(ids[:, :200], attention_mask=mask[:, :200], past_key_values=cache, use_cache=True)
    assert_sinks_and_latest(cache, mask)
    plans = []
    original = scoring.plan
    monkeypatch.setattr(scoring, "plan", lambda *args, **kw: plans.append(1) or original(*args, **kw))
    return model, ids, mask, cache, plans


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_steps_keep_sinks_and_latest_blocks_without_a_selection(family, monkeypatch):
    """Decode forwards of 1 and 3 tokens (block boundaries crossed inside a forward) over left-padded sequences,
    12 new blocks (every block the prefill placed is evicted, then those the steps added): after every forward
    each layer holds the sink and the latest blocks, and no selection plan ran."""
    model, ids, mask, cache, plans = _prefilled(family, monkeypatch)
    length, step = 200, 0
    with torch.no_grad():
        while length < ids.shape[1] - 3:
            width = 3 if step % 2 else 1
            model(ids[:, length : length + width], attention_mask=mask[:, : length + width],
                  past_key_values=cache, use_cache=True)
            length += width
            assert_sinks_and_latest(cache, mask)
            step += 1
    assert not plans


def test_static_crop_of_rejected_drafts_refetches_the_blocks_they_evicted(monkeypatch):
    """A verification forward that crosses into a new block evicts the oldest unpinned one; when the drafts past
    the boundary are rejected, the crop drops the new block and refetches the evicted one (one plan per layer); a crop
    that stays inside the last block refetches nothing."""
    model, ids, mask, cache, plans = _prefilled("llama", monkeypatch)
    length = 200
    with torch.no_grad():
        for _ in range(4):
            step_to = ((length + 5) // BS + 1) * BS + 2  # two tokens into a block the last crop did not reach
            while length < step_to - 5:
                model(ids[:, length : length + 1], attention_mask=mask[:, : length + 1], past_key_values=cache,
                      use_cache=True)
                length += 1
            model(ids[:, length : length + 5], attention_mask=mask[:, : length + 5], past_key_values=cache,
                  use_cache=True)
            length += 5
            assert_sinks_and_latest(cache, mask)
            assert not plans
            cache.crop(-3)  # back before the boundary
            length -= 3
            assert_sinks_and_latest(cache, mask)
            assert len(plans) == len(cache.layers)
            plans.clear()
        # A crop inside the last block drops no block: nothing to refetch, no plan.
        model(ids[:, length : length + 1], attention_mask=mask[:, : length + 1], past_key_values=cache, use_cache=True)
        cache.crop(-1)
        assert_sinks_and_latest(cache, mask)
        assert not plans
