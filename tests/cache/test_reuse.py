"""A cache reused across generate calls (`OasisCache.reset`, `oasis_hf.CacheSlot`): the allocations and captured
graphs stay, and every call decodes exactly as a fresh cache does."""

import pytest
import torch

import oasis_hf
from oasis_hf.integrations import fast_path
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded

# A budget below the context: selections and fetches differ from prompt to prompt, so state left over from an earlier
# call would change the tokens.
SMALL = dict(budget_tokens=96, max_fetch_blocks=2, host_growth_tokens=16)


def _fresh(model, ids, mask, **fields):
    with oasis_cache(model, **fields) as cache:
        return generate(model, ids, mask, cache)


@pytest.mark.parametrize("selector", ["lookahead", "current-query", "static"])
def test_a_reset_cache_keeps_its_buffers_and_decodes_as_a_fresh_one(selector):
    model = tiny_model("llama", attn="oasis")
    fields = dict(SMALL, selector=selector)
    first_ids, first_mask = left_padded([150, 97], seed=1)
    ids, mask = left_padded([131, 140], seed=2)
    with oasis_cache(model, **fields) as cache:
        generate(model, first_ids, first_mask, cache)
        layer, host, epoch = cache.oasis_layers[0], cache.host, cache.table_epoch
        pool, table, starts = layer.pool_k.data_ptr(), layer.table.slot_block.data_ptr(), layer.kv_start.data_ptr()
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.host is host and cache.table_epoch == epoch
        out = generate(model, ids, mask, cache)
        assert (layer.pool_k.data_ptr(), layer.table.slot_block.data_ptr(), layer.kv_start.data_ptr()) == (
            pool, table, starts)
        assert cache.host is host and cache.table_epoch == epoch  # 140 + 24 tokens fit the first call's store
    assert torch.equal(out, _fresh(model, ids, mask, **fields))


def test_a_reset_cache_reallocates_for_another_batch_size():
    model = tiny_model("llama", attn="oasis")
    with oasis_cache(model, **SMALL) as cache:
        generate(model, *left_padded([150, 97], seed=1), cache)
        epoch = cache.table_epoch
        cache.reset()
        ids, mask = left_padded([120], seed=3)
        out = generate(model, ids, mask, cache)
        assert cache.table_epoch > epoch and cache.host.batch_size == 1
        assert all(layer.batch_size == 1 for layer in cache.oasis_layers)
    assert torch.equal(out, _fresh(model, ids, mask, **SMALL))


def test_a_longer_prompt_after_reset_grows_the_kept_store():
    model = tiny_model("llama", attn="oasis")
    with oasis_cache(model, **SMALL) as cache:
        generate(model, *left_padded([40], seed=1), cache)
        capacity, epoch = cache.host_capacity_blocks, cache.table_epoch
        cache.reset()
        ids, mask = left_padded([300], seed=4)
        out = generate(model, ids, mask, cache)
        assert cache.host_capacity_blocks > capacity and cache.table_epoch > epoch
    assert torch.equal(out, _fresh(model, ids, mask, **SMALL))


def test_reset_after_a_graph_path_call_replays_the_same_runner(monkeypatch):
    """Through `oasis_hf.enable`'s fast path (run eagerly on the CPU): the runner stays on the reset cache and the
    next call goes through it, with the tokens of a fresh cache."""
    monkeypatch.setattr(fast_path, "GRAPH_DEVICES", ("cuda", "cpu"))
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([131, 140], seed=2)
    with oasis_cache(model, **SMALL) as cache:
        generate(model, *left_padded([150, 97], seed=1), cache)
        runner = cache.graph_runner
        cache.reset()
        out = generate(model, ids, mask, cache)
        assert cache.graph_runner is runner and runner.steps == 2 * 23
    assert torch.equal(out, _fresh(model, ids, mask, **SMALL))


def test_decode_generate_over_a_reset_cache_equals_a_fresh_one():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([131, 140], seed=2)
    with oasis_cache(model, **SMALL) as cache:
        oasis_hf.decode_generate(model, *left_padded([150, 97], seed=1), cache=cache, max_new_tokens=12)
        with pytest.raises(oasis_hf.UnsupportedError, match="empty OasisCache.*reset"):
            oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=12)
        runner = cache.graph_runner
        cache.reset()
        out = oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=12)
        assert cache.graph_runner is runner
    with oasis_cache(model, **SMALL) as fresh:
        assert torch.equal(out, oasis_hf.decode_generate(model, ids, mask, cache=fresh, max_new_tokens=12))


def test_cache_slot_hands_out_one_cache_and_replaces_a_failed_one():
    model = tiny_model("llama", attn="oasis")
    slot = oasis_hf.CacheSlot(model.config, oasis_hf.OasisConfig(block_size=16, sink_tokens=16, recent_tokens=32,
                                                                  **SMALL))
    ids, mask = left_padded([131, 140], seed=2)
    with slot.cache() as cache:
        generate(model, *left_padded([150, 97], seed=1), cache)
        with pytest.raises(RuntimeError, match="in use by another block"), slot.cache():
            pass
    with slot.cache() as again:
        assert again is cache and again.get_seq_length() == 0
        out = generate(model, ids, mask, again)
    assert torch.equal(out, _fresh(model, ids, mask, **SMALL))
    with pytest.raises(ValueError, match="boom"), slot.cache():
        raise ValueError("boom")
    assert slot.current is None  # the failed block's cache is closed, not handed out again
    with pytest.raises(oasis_hf.UnsupportedError, match="was closed"):
        cache.check_prompt(ids)
    with slot.cache() as new:
        assert new is not cache
    slot.close()
    assert slot.current is None
    with pytest.raises(oasis_hf.UnsupportedError, match="was closed"):
        new.check_prompt(ids)


def test_a_call_in_another_inference_mode_reallocates():
    """Buffers made under ``torch.inference_mode`` (decode_generate) refuse in-place writes outside it: the next
    call through ``model.generate`` (``no_grad``) reallocates instead of failing, and decodes as a fresh cache."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([131, 140], seed=2)
    with oasis_cache(model, **SMALL) as cache:
        oasis_hf.decode_generate(model, *left_padded([150, 97], seed=1), cache=cache, max_new_tokens=12)
        epoch = cache.table_epoch
        cache.reset()
        out = generate(model, ids, mask, cache)
        assert cache.table_epoch > epoch and not cache.oasis_layers[0].pool_k.is_inference()
    assert torch.equal(out, _fresh(model, ids, mask, **SMALL))


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["lookahead", "current-query"])
def test_generate_over_a_reset_cache_replays_the_graph_the_first_call_captured(selector):
    """On CUDA (`oasis_hf.enable`'s fast path): the second generate call over a reset cache captures nothing, its
    decode forwards replay the whole-step graph of the first, and it gives the tokens of a fresh cache; a call at
    another batch size captures anew."""
    model = tiny_model("llama", attn="oasis", device="cuda")
    fields = dict(SMALL, selector=selector)
    ids, mask = (t.cuda() for t in left_padded([131, 140], seed=2))
    with oasis_cache(model, **fields) as cache:
        generate(model, *(t.cuda() for t in left_padded([150, 97], seed=1)), cache)
        runner = cache.graph_runner
        captures, replays = runner.captures, runner.replays
        assert captures >= 1
        cache.reset()
        out = generate(model, ids, mask, cache)
        assert cache.graph_runner is runner and runner.captures == captures
        assert runner.replays == replays + 23  # every decode forward of the 24 new tokens but the prefill
        cache.reset()
        single, single_mask = (t.cuda() for t in left_padded([120], seed=3))
        one = generate(model, single, single_mask, cache)
        assert cache.graph_runner is not runner and cache.graph_runner.captures >= 1
    assert torch.equal(out, _fresh(model, ids, mask, **fields))
    assert torch.equal(one, _fresh(model, single, single_mask, **fields))
