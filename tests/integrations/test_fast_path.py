"""The whole-step graph path that `oasis_hf.enable` installs for ``model(...)`` / ``model.generate``.

On the CPU that path runs the same per-layer work eagerly (no capture), so these tests put the CPU in
`fast_path.GRAPH_DEVICES` and check the routing (positions, ``logits_to_keep``, return types, fallbacks) against the
model's own forward, through transformers' generation loop; the capture itself is checked on CUDA (``gpu``)."""

import gc
import logging
import weakref

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import oasis_hf
from oasis_hf import compat
from oasis_hf.integrations import fast_path
from tests._factories import VOCAB, oasis_cache, tiny_model
from tests.test_generate import generate, left_padded

SMALL = dict(budget_tokens=128, max_fetch_blocks=2)  # 8 slots of 16: evictions and fetches on these prompts


@pytest.fixture
def graph_on_cpu(monkeypatch):
    monkeypatch.setattr(fast_path, "GRAPH_DEVICES", ("cuda", "cpu"))


def _both(model, ids, mask, fields, **kw):
    """(tokens with whole_step off, tokens through the graph path, the graph runner's step count)."""
    with oasis_cache(model, whole_step=False, **fields) as cache:
        eager = generate(model, ids, mask, cache, **kw)
        assert cache.graph_runner is None
    with oasis_cache(model, **fields) as cache:
        graphed = generate(model, ids, mask, cache, **kw)
        steps = cache.graph_runner.steps if cache.graph_runner is not None else 0
    return eager, graphed, steps


@pytest.mark.parametrize("selector", ["lookahead", "current-query", "static"])
def test_generate_takes_the_graph_path_and_gives_the_same_tokens(graph_on_cpu, selector):
    """Left-padded batch of 3 under a budget below the context: every decode forward of generate goes through the
    cache's DecodeGraph and picks, fetches and attends as the model's own forward does."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([150, 97, 131])
    eager, graphed, steps = _both(model, ids, mask, dict(SMALL, selector=selector))
    assert torch.equal(graphed, eager)
    assert steps == 23  # 24 new tokens: the prefill, then 23 decode forwards


def test_generation_features_behave_as_with_dense_attention(graph_on_cpu):
    """Budget covering the context: EOS, a stopping criterion, a streamer, a logits processor and sampling through
    the graph path give what DynamicCache gives."""
    model = oasis_hf.enable(tiny_model("qwen2"))
    dense = tiny_model("qwen2")
    ids, mask = left_padded([120, 90], seed=5)
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    eos = int(ref[0, ids.shape[1] + 5])  # a token the first sequence emits: it stops there

    class AfterTen(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 10, dtype=torch.bool)

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.chunks.append(None)

    for kw in (dict(eos_token_id=eos), dict(stopping_criteria=StoppingCriteriaList([AfterTen()])),
               dict(repetition_penalty=1.3)):
        want = generate(dense, ids, mask, DynamicCache(config=dense.config), **kw)
        with oasis_cache(model) as cache:
            assert torch.equal(generate(model, ids, mask, cache, **kw), want), kw
            assert cache.graph_runner is not None and cache.graph_runner.steps > 0
    streamed = []
    for cache in (DynamicCache(config=dense.config), oasis_cache(model)):
        streamer = Collect()
        generate(dense if isinstance(cache, DynamicCache) else model, ids[:1], mask[:1], cache, streamer=streamer)
        streamed.append(torch.cat([c.view(-1) for c in streamer.chunks if c is not None]))
    assert torch.equal(streamed[0], streamed[1])
    samples = []
    for cache in (DynamicCache(config=dense.config), oasis_cache(model)):
        torch.manual_seed(7)
        which = dense if isinstance(cache, DynamicCache) else model
        samples.append(which.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=24,
                                      do_sample=True, top_k=20, pad_token_id=0))
    torch.testing.assert_close(samples[0], samples[1])


@pytest.mark.parametrize("drafts", ["assistant_model", "prompt_lookup"])
def test_assisted_generation_verifies_through_the_graph_path(graph_on_cpu, drafts):
    """transformers' assisted generation (a draft model or prompt lookup, batch 1): the target's verification
    forwards (1 + k tokens) take the graph path, the cache is cropped after each, and the tokens are the eager
    path's."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([140])
    kw = dict(assistant_model=tiny_model("llama", layers=1)) if drafts == "assistant_model" else dict(
        prompt_lookup_num_tokens=3)
    eager, graphed, steps = _both(model, ids, mask, dict(SMALL, selector="lookahead"), **kw)
    assert torch.equal(graphed, eager)
    assert 0 < steps <= 23


def test_the_cache_keyword_spelling_takes_the_graph_path(graph_on_cpu):
    model = oasis_hf.enable(tiny_model("llama"))
    if compat.cache_kwarg(model) != "cache":
        pytest.skip("this transformers has no cache= argument (5.17 spells it past_key_values)")
    ids, mask = left_padded([100])
    with oasis_cache(model, **SMALL) as cache:
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0)
        assert cache.graph_runner.steps == 7
    with oasis_cache(model, whole_step=False, **SMALL) as cache:
        ref = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=8, min_new_tokens=8,
                             do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_what_the_graph_cannot_take_runs_eagerly_and_says_why_once(graph_on_cpu, caplog):
    """Hidden states asked for, sliding-window layers (Gemma3), the stale policy: eager, one log line per reason and
    model; a DynamicCache, the prefill and whole_step=False: eager without a word."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([90])
    caplog.set_level(logging.INFO, logger="oasis_hf.integrations.fast_path")
    with oasis_cache(model) as cache:
        generate(model, ids, mask, cache, output_hidden_states=True, return_dict_in_generate=True,
                 min_new_tokens=4)
        assert cache.graph_runner is None
    with oasis_cache(model) as cache:
        generate(model, ids, mask, cache, output_hidden_states=True, return_dict_in_generate=True,
                 min_new_tokens=4)
    with oasis_cache(model, prefetch_policy="stale", selector="lookahead") as cache:
        generate(model, ids, mask, cache, min_new_tokens=4)
        assert cache.graph_runner is None
    gemma = oasis_hf.enable(tiny_model("gemma3"))
    with oasis_cache(gemma) as cache:
        generate(gemma, ids, mask, cache, min_new_tokens=4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "hidden states" in lines[0] and "prefetch_policy='wait'" in lines[1] and "sliding-window" in lines[2]
    caplog.clear()
    dense = oasis_hf.enable(tiny_model("llama"))
    generate(dense, ids, mask, DynamicCache(config=dense.config), min_new_tokens=4)
    with oasis_cache(model, whole_step=False) as cache:
        generate(model, ids, mask, cache, min_new_tokens=4)
        assert cache.graph_runner is None
    assert not caplog.records


def test_enable_installs_once_and_keeps_the_forward_signature():
    """transformers reads the forward's parameters (logits_to_keep, cache_position): the wrapper keeps them."""
    import inspect

    model = tiny_model("llama")
    before = inspect.signature(model.forward)
    oasis_hf.enable(model)
    wrapped = model.forward
    oasis_hf.enable(model)
    assert model.forward is wrapped
    assert inspect.signature(model.forward) == before and "logits_to_keep" in before.parameters


def test_the_runner_does_not_keep_its_cache_alive(graph_on_cpu):
    """The cache owns its DecodeGraph, which holds the cache weakly: a dropped cache is freed (by the collector:
    its layers still point back at it)."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([80])
    cache = oasis_cache(model)
    generate(model, ids, mask, cache)
    runner, alive = cache.graph_runner, weakref.ref(cache)
    cache.close()
    del cache
    gc.collect()
    assert alive() is None
    with pytest.raises(oasis_hf.UnsupportedError, match="garbage-collected"):
        runner(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))


def test_model_calls_outside_generate_take_the_graph_path(graph_on_cpu):
    """``model(input_ids, past_key_values=cache, ...)`` after a prefill: logits of the graph path (tuple and
    dataclass returns, logits_to_keep) equal the eager forward's."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([70])
    outs = []
    for whole_step in (False, True):
        with oasis_cache(model, whole_step=whole_step) as cache, torch.inference_mode():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(0))
            full = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            last = model(input_ids=token[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1,
                         return_dict=False)[0]
            outs.append((full, last))
            assert (cache.graph_runner is not None) == whole_step
    torch.testing.assert_close(outs[1][0], outs[0][0])
    torch.testing.assert_close(outs[1][1], outs[0][1])
    assert outs[1][0].shape == (1, 3, VOCAB) and outs[1][1].shape == (1, 1, VOCAB)


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["lookahead", "current-query"])
def test_generate_on_cuda_replays_the_whole_step_graph(selector):
    """On CUDA generate's decode forwards are graph replays (captured after one eager warm-up per T) and give the
    per-layer path's tokens, left padding and a below-context budget included; assisted generation too."""
    model = oasis_hf.enable(tiny_model("llama", device="cuda"))
    ids, mask = left_padded([150, 97, 131])
    ids, mask = ids.cuda(), mask.cuda()
    fields = dict(SMALL, selector=selector)
    with oasis_cache(model, whole_step=False, **fields) as cache:
        ref = generate(model, ids, mask, cache)
    with oasis_cache(model, **fields) as cache:
        out = generate(model, ids, mask, cache)
        assert cache.graph_runner.replays >= 20
    assert torch.equal(out, ref)
    draft = tiny_model("llama", layers=1, device="cuda")
    with oasis_cache(model, whole_step=False, **fields) as cache:
        ref = generate(model, ids[:1], mask[:1], cache, assistant_model=draft)
    with oasis_cache(model, **fields) as cache:
        assert torch.equal(generate(model, ids[:1], mask[:1], cache, assistant_model=draft), ref)
        assert cache.graph_runner.steps > 0


def test_the_pipeline_takes_the_graph_path(graph_on_cpu):
    """`oasis_hf.text_generation_pipeline` (its own cache, reset after every call) decodes through the cache's
    DecodeGraph with nothing but the pipeline call, and gives the text of the eager path."""
    from tests._factories import tiny_tokenizer, words

    tok, prompt = tiny_tokenizer(), words(150, seed=1)
    cfg = dict(block_size=16, sink_tokens=16, recent_tokens=32, budget_tokens=128)
    texts, steps = [], []
    for whole_step in (False, True):
        pipe = oasis_hf.text_generation_pipeline(tiny_model("llama"), tok, oasis_hf.OasisConfig(**cfg,
                                                                                                 whole_step=whole_step))
        texts.append(pipe(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"])
        runner = pipe.cache_slot.current.graph_runner
        steps.append(runner.steps if runner is not None else 0)
    assert texts[0] == texts[1]
    assert steps == [0, 11]  # the prefill, then 11 decode forwards through the graph
