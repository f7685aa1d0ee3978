"""Misuse of a cache is refused with an error that names the problem and the fix, before it changes any state:
a closed cache, one cache fed from two threads, a cache built for another model, a cache left mid-forward, a cache
reused for another prompt."""

import threading

import pytest
import torch
from transformers import DynamicCache

import oasis_hf
from oasis_hf import OasisError, UnsupportedError
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded


def test_a_closed_cache_refuses_further_use():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100])
    cache = oasis_cache(model, selector="lookahead", budget_tokens=128, max_fetch_blocks=2)
    generate(model, ids, mask, cache)
    cache.close()
    with pytest.raises(OasisError, match="was closed; make a new OasisCache"):
        generate(model, ids, mask, cache)


def test_one_cache_fed_from_two_threads_is_refused_in_the_second():
    """The thread that first feeds a cache owns it until reset(); another thread gets a clear error, not a shape
    error or quietly wrong tokens."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100])
    cache = oasis_cache(model)
    generate(model, ids, mask, cache)
    errors = []

    def other():
        try:
            generate(model, ids, mask, cache)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], UnsupportedError)
    assert "in use by another thread" in str(errors[0])
    cache.reset()  # handed over: the next thread to feed it owns it
    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert len(errors) == 1


def test_a_cache_for_another_model_is_refused_by_name():
    """A Gemma3-config cache on a Llama model (other KV heads), a 2-layer cache on a 4-layer model, a 4-layer cache
    on a 2-layer model: refused at the first forward that shows it (before: wrong tokens, an IndexError, and
    silently unused layers)."""
    llama = tiny_model("llama", attn="oasis")
    gemma = tiny_model("gemma3", attn="oasis")
    ids, mask = left_padded([60])
    with pytest.raises(UnsupportedError, match="1 x 16.*OasisCache\\(model.config"):
        generate(llama, ids, mask, oasis_cache(gemma))
    deeper = tiny_model("llama", layers=4, attn="oasis")
    with pytest.raises(UnsupportedError, match="sent layer 2.*config with 2 layers"):
        generate(deeper, ids, mask, oasis_cache(llama))
    with pytest.raises(UnsupportedError, match="left layers \\[2, 3\\].*fewer layers"):
        generate(llama, ids, mask, oasis_cache(deeper))


def test_an_interrupted_forward_marks_the_cache_until_reset(monkeypatch):
    """An interrupt between one layer's update and its attention (KeyboardInterrupt in layer 1 of the prefill)
    leaves the cache refusing further forwards with a message naming reset(); after reset() it decodes as a fresh
    cache does."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100, 80])
    with oasis_cache(model) as fresh:
        want = generate(model, ids, mask, fresh)
    cache = oasis_cache(model)
    attend = oasis_hf.cache.OasisLayer.attend

    def interrupted(layer, *args, **kwargs):
        if layer.layer_idx == 1:
            raise KeyboardInterrupt
        return attend(layer, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(oasis_hf.cache.OasisLayer, "attend", interrupted)
        with pytest.raises(KeyboardInterrupt):
            generate(model, ids, mask, cache)
    with pytest.raises(OasisError, match="left in the middle of a forward.*cache.reset\\(\\)"):
        generate(model, ids, mask, cache)
    cache.reset()
    assert torch.equal(generate(model, ids, mask, cache), want)


def test_a_model_not_on_the_oasis_attention_is_still_named():
    """Every layer updated and no attention ran: the layer's own message (switch the attention) comes first."""
    model = tiny_model("llama")  # SDPA attention, never switched
    ids, mask = left_padded([60])
    with pytest.raises(UnsupportedError, match="not using the 'oasis' attention"):
        generate(model, ids, mask, oasis_cache(model))


def test_a_cache_with_other_layer_types_is_refused():
    """Same heads and head dim, other layer types: a full-attention cache on a model whose first layers use a
    sliding window, and a sliding-window cache on a model attending fully everywhere; refused at the first layer
    that differs, instead of attending over the wrong span of tokens there."""
    import copy

    gemma = tiny_model("gemma3", attn="oasis")
    config = copy.deepcopy(gemma.config)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    ids, mask = left_padded([60])
    with pytest.raises(UnsupportedError, match="layer 0 attends over a sliding window.*OasisCache\\(model.config"):
        generate(gemma, ids, mask, oasis_hf.OasisCache(config, oasis_hf.OasisConfig(block_size=16, sink_tokens=16,
                                                                                    recent_tokens=32)))
    full = tiny_model("gemma3", attn="oasis")
    full.config.layer_types = ["full_attention"] * full.config.num_hidden_layers
    for layer in full.model.layers:  # every module attends over the whole sequence now
        layer.self_attn.sliding_window = None
        layer.attention_type = "full_attention"
    with pytest.raises(UnsupportedError, match="layer 0 attends over the whole sequence.*sliding-window layer"):
        generate(full, ids, mask, oasis_hf.OasisCache(gemma.config, oasis_hf.OasisConfig(block_size=16,
                                                                                         sink_tokens=16,
                                                                                         recent_tokens=32)))


def test_a_cache_reused_for_another_prompt_is_refused_and_a_continuation_is_not():
    """A second generate call on a cache holding tokens: a prompt of no more tokens than it holds, or one that does
    not start with the previous output, is refused before any forward (the cache keeps its tokens); the previous
    output continued gives the tokens a DynamicCache continued the same way gives; after reset() any prompt goes."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([150, 97])
    other, other_mask = left_padded([150, 97], seed=5)
    dense, kv = tiny_model("llama"), DynamicCache()
    step = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = dense.generate(input_ids=ids, attention_mask=mask, past_key_values=kv, **step)
    whole = dense.generate(input_ids=out, attention_mask=torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])],
                                                                   dim=1), past_key_values=kv, **step)
    with oasis_cache(model) as cache:
        first = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                               do_sample=False, pad_token_id=0)
        held = cache.get_seq_length()
        with pytest.raises(UnsupportedError, match=rf"already holds {held} tokens.*no more than.*cache.reset\(\)"):
            generate(model, other, other_mask, cache)
        longer = torch.cat([other, first[:, :8]], dim=1)
        with pytest.raises(UnsupportedError, match="does not start with the tokens of its previous generate call"):
            generate(model, longer, torch.ones_like(longer), cache)
        assert cache.get_seq_length() == held  # nothing ran
        full_mask = torch.cat([mask, torch.ones_like(first[:, ids.shape[1]:])], dim=1)
        again = model.generate(input_ids=first, attention_mask=full_mask, past_key_values=cache, max_new_tokens=6,
                               do_sample=False, pad_token_id=0)
        assert torch.equal(again, whole)
        cache.reset()
        fresh = generate(model, other, other_mask, cache)
    with oasis_cache(model) as cache:
        assert torch.equal(fresh, generate(model, other, other_mask, cache))


def test_right_padding_is_refused_and_the_mask_is_read_once_per_prefill():
    """OasisCache keeps left-padded batches only (real tokens contiguous at the end): right padding is refused with
    the tokenizer setting to change. A left-padded prefill reads the mask once: every layer gets the same starts."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100, 60])
    cache = oasis_cache(model, budget_tokens=128)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    starts = [layer.kv_start for layer in cache.oasis_layers]
    assert all(s is starts[0] for s in starts) and starts[0].tolist() == [0, 40]
    right = mask.flip(-1)
    with pytest.raises(UnsupportedError, match="padding_side = 'left'"):
        model(input_ids=ids, attention_mask=right, past_key_values=oasis_cache(model, budget_tokens=128),
              use_cache=True)
