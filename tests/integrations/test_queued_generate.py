"""``model.generate`` with the stop check one step late (`oasis_hf.integrations.queued_generate`).

On the CPU the loop runs the same way (the flag is copied at once instead of through pinned memory and an event), so
these tests put the CPU in `fast_path.GRAPH_DEVICES` and compare with transformers' own loop over a `DynamicCache`
and over an OasisCache with ``queued_generate=False``: tokens, EOS, the extra step's undo (cache length, forwards
run), streamers, scores; the CUDA run is ``gpu``."""

import logging

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import oasis_hf
from oasis_hf.integrations import fast_path, queued_generate
from tests._factories import VOCAB, oasis_cache, tiny_model
from tests.test_generate import generate, left_padded

SMALL = dict(budget_tokens=128, max_fetch_blocks=2)


@pytest.fixture
def graph_on_cpu(monkeypatch):
    monkeypatch.setattr(fast_path, "GRAPH_DEVICES", ("cuda", "cpu"))


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.clone().view(-1))

    def end(self):
        self.chunks.append(None)


def _run(model, ids, mask, queued: bool, **kw):
    """(tokens, graph forwards run, cache length afterwards, whether queued_sample ran)."""
    with pytest.MonkeyPatch.context() as mp:
        calls = _spied(mp)
        with oasis_cache(model, queued_generate=queued, **SMALL) as cache:
            out = generate(model, ids, mask, cache, **kw)
            return out, cache.graph_runner.steps, cache.get_seq_length(), bool(calls)


def _spied(monkeypatch) -> list:
    """A list that gets one entry per call of `queued_sample` while `monkeypatch` is active."""
    calls = []
    original = queued_generate.queued_sample

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(queued_generate, "queued_sample", spy)
    return calls


def test_routing_follows_the_cache_and_the_call(graph_on_cpu):
    model = oasis_hf.enable(tiny_model("llama"))
    with oasis_cache(model) as cache:
        assert queued_generate.queued(model, cache, {})
        for kw in (dict(assistant_model=model), dict(prompt_lookup_num_tokens=3), dict(synced_gpus=True),
                   dict(custom_generate=lambda *a, **k: None)):
            assert not queued_generate.queued(model, cache, kw), kw
    assert not queued_generate.queued(model, DynamicCache(config=model.config), {})
    for field in ("queued_generate", "whole_step", "cuda_graphs"):
        with oasis_cache(model, **{field: False}) as cache:
            assert not queued_generate.queued(model, cache, {}), field


def test_the_cpu_keeps_transformers_loop():
    """The graph path (and with it the queued loop) is for CUDA; on the CPU generate is transformers' own."""
    model = oasis_hf.enable(tiny_model("llama"))
    with oasis_cache(model) as cache:
        assert not queued_generate.queued(model, cache, {})


class AfterSeven(StoppingCriteria):
    """Ends every sequence at its 7th new token (a stop before max_new_tokens, as an EOS of every row would)."""

    def __init__(self, prompt: int):
        self.prompt = prompt

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.prompt + 7, dtype=torch.bool,
                          device=input_ids.device)


@pytest.mark.parametrize("stop", ["max_new_tokens", "criterion"])
def test_queued_loop_gives_transformers_tokens_and_undoes_the_extra_step(graph_on_cpu, stop):
    """Left-padded batch of 3 under a budget below the context (the tiny model's default EOS ends one row early).
    Stopped by max_new_tokens the loop runs as many forwards as transformers' loop; stopped by a criterion that ends
    every sequence it runs one more, whose token and K/V are dropped again: same tokens, same cache length."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([150, 97, 131])
    kw = dict(stopping_criteria=StoppingCriteriaList([AfterSeven(ids.shape[1])])) if stop == "criterion" else {}
    ref, ref_steps, ref_length, ref_queued = _run(model, ids, mask, queued=False, **kw)
    out, steps, length, ran = _run(model, ids, mask, queued=True, **kw)
    assert ran and not ref_queued
    assert torch.equal(out, ref)
    assert length == ref_length == out.shape[1] - 1
    if stop == "criterion":
        assert out.shape[1] == ids.shape[1] + 7
        assert steps == ref_steps + 1 == 7  # the step after the stop, undone
    else:
        assert steps == ref_steps == 23


def test_eos_stopping_criterion_streamer_and_scores_as_with_dynamic_cache(graph_on_cpu):
    """Budget covering the context: an EOS that stops the batch early, the streamed chunks (prompt, then every kept
    token once, the dropped step's never) and the scores and logits of ``return_dict_in_generate`` are those of
    transformers' loop over a DynamicCache."""
    model = oasis_hf.enable(tiny_model("qwen2"))
    dense = tiny_model("qwen2")
    ids, mask = left_padded([120], seed=3)
    free = generate(dense, ids, mask, DynamicCache(config=dense.config))
    eos = int(free[0, ids.shape[1] + 9])
    new = int((free[0, ids.shape[1]:] == eos).nonzero()[0]) + 1  # tokens up to its first EOS
    assert new < 24
    results = []
    for which, cache in ((dense, DynamicCache(config=dense.config)), (model, oasis_cache(model))):
        streamer = Collect()
        out = which.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=24,
                             do_sample=False, pad_token_id=0, eos_token_id=eos, streamer=streamer,
                             return_dict_in_generate=True, output_scores=True, output_logits=True)
        results.append((out, streamer.chunks))
    (want, want_chunks), (got, got_chunks) = results
    assert got.get("cache", got.get("past_key_values")) is cache  # the OasisCache, under this transformers' name
    assert got.sequences.shape[1] == ids.shape[1] + new  # stopped at the EOS
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == new and len(got.logits) == new
    for a, b in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(a, b)
    assert got.scores[0].shape == (1, VOCAB)
    assert len(got_chunks) == len(want_chunks) and got_chunks[-1] is None
    for a, b in zip(got_chunks[:-1], want_chunks[:-1], strict=True):
        assert torch.equal(a, b)


def test_sampling_draws_as_transformers_loop(graph_on_cpu):
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([100, 70])
    samples = []
    for queued in (False, True):
        with oasis_cache(model, queued_generate=queued) as cache:
            torch.manual_seed(11)
            samples.append(model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                          max_new_tokens=16, do_sample=True, top_k=20, pad_token_id=0))
    assert torch.equal(samples[0], samples[1])


def test_what_the_queued_loop_does_not_cover_runs_transformers_loop(graph_on_cpu, caplog):
    """Hidden states requested: transformers' own loop runs (and the forwards go eager), with a log line saying
    why; the tokens are unchanged."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([90])
    with oasis_cache(model, whole_step=False) as cache:
        ref = generate(model, ids, mask, cache)
    with caplog.at_level(logging.INFO, logger="oasis_hf"), oasis_cache(model) as cache:
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=24,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                             output_hidden_states=True)
    assert torch.equal(out.sequences, ref)
    assert "attention weights or hidden states requested" in caplog.text
    assert "transformers' decoding loop" in caplog.text


@pytest.mark.gpu
def test_queued_loop_on_cuda_replays_and_matches_transformers_loop():
    """On CUDA (the real target: flags through pinned memory and events) the queued loop replays the whole-step
    graph and gives transformers' tokens, a stop before max_new_tokens included."""
    model = oasis_hf.enable(tiny_model("llama", device="cuda"))
    ids, mask = left_padded([150, 97, 131])
    ids, mask = ids.cuda(), mask.cuda()
    for kw in ({}, dict(stopping_criteria=StoppingCriteriaList([AfterSeven(ids.shape[1])]))):
        ref, _, ref_length, _ = _run(model, ids, mask, queued=False, **kw)
        out, steps, length, ran = _run(model, ids, mask, queued=True, **kw)
        assert ran and steps > 0
        assert torch.equal(out, ref) and length == ref_length, kw


def test_the_pipeline_decodes_with_the_queued_loop(graph_on_cpu, monkeypatch):
    """`oasis_hf.text_generation_pipeline` (its own cache per call) takes the queued loop with nothing but the
    pipeline call, and gives the text of transformers' loop."""
    from tests._factories import tiny_tokenizer, words

    calls = _spied(monkeypatch)
    tok, prompt = tiny_tokenizer(), words(150, seed=2)
    texts = []
    for queued in (False, True):
        config = oasis_hf.OasisConfig(block_size=16, sink_tokens=16, recent_tokens=32, budget_tokens=128,
                                      queued_generate=queued)
        pipe = oasis_hf.text_generation_pipeline(tiny_model("llama"), tok, config)
        texts.append(pipe(prompt, max_new_tokens=12, do_sample=False)[0]["generated_text"])
        assert bool(calls) == queued
    assert texts[0] == texts[1]


def test_lm_eval_generate_until_decodes_with_the_queued_loop(graph_on_cpu, monkeypatch):
    """The lm-eval model's plain requests (no drafts, ``graphs`` off) go through ``model.generate``, hence the queued
    loop, with lm-eval's stop-sequence criteria: the texts of transformers' loop."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; `pip install -e .[dev]`")
    from lm_eval.api.instance import Instance

    from oasis_hf.integrations.lm_eval import OasisLM
    from tests._factories import tiny_tokenizer

    calls = _spied(monkeypatch)
    tok = tiny_tokenizer()
    prompts = [" ".join(f"w{(i * 7 + j) % 90}" for j in range(n)) for i, n in enumerate((40, 55, 31))]
    texts = []
    for queued in (False, True):
        lm = OasisLM(pretrained=tiny_model("llama"), tokenizer=tok, budget=128, block_size=16, device="cpu",
                     batch_size=3, max_length=1024, queued_generate=queued)
        gen = {"until": ["w3"], "max_gen_toks": 12, "do_sample": False}
        requests = [Instance(request_type="generate_until", doc={}, arguments=(p, dict(gen)), idx=i)
                    for i, p in enumerate(prompts)]
        texts.append(lm.generate_until(requests, disable_tqdm=True))
        assert bool(calls) == queued
    assert all(texts[0]) and texts[0] == texts[1]


def test_a_continuation_after_a_stopped_call_matches_transformers_loop(graph_on_cpu):
    """A second generate call that continues the first one's output on the same cache (transformers' continuation
    from a cache): after a call the criterion stopped early (extra step undone), the tokens are those of
    transformers' loop."""
    model = oasis_hf.enable(tiny_model("llama"))
    ids, mask = left_padded([120, 90])
    stop = StoppingCriteriaList([AfterSeven(ids.shape[1])])
    outs = []
    for queued in (False, True):
        with oasis_cache(model, queued_generate=queued, **SMALL) as cache:
            first = generate(model, ids, mask, cache, stopping_criteria=stop)
            assert first.shape[1] == ids.shape[1] + 7
            longer = torch.cat([mask, mask.new_ones(mask.shape[0], first.shape[1] - ids.shape[1])], dim=1)
            outs.append(model.generate(input_ids=first, attention_mask=longer, past_key_values=cache,
                                       max_new_tokens=8, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
