"""OasisKV through transformers' text-generation pipeline."""

import pytest
import torch
from transformers import pipeline

import oasis_hf
from oasis_hf import OasisConfig, UnsupportedError
from tests._factories import tiny_model, tiny_tokenizer, words

CFG = OasisConfig(block_size=16, sink_tokens=16, recent_tokens=32, budget_tokens=4096)  # covers the context


def test_two_prompts_in_one_call_equal_two_dense_runs():
    tok = tiny_tokenizer()
    prompts = [words(150, seed=1), words(97, seed=2)]
    dense = pipeline("text-generation", model=tiny_model("llama"), tokenizer=tok)
    expected = [dense(p, max_new_tokens=12, do_sample=False)[0]["generated_text"] for p in prompts]
    pipe = oasis_hf.text_generation_pipeline(tiny_model("llama"), tok, CFG)
    got = pipe(prompts, max_new_tokens=12, do_sample=False, batch_size=2)
    assert [g[0]["generated_text"] for g in got] == expected
    # and again: nothing leaks from one call to the next (a fresh cache per call)
    again = pipe(prompts[::-1], max_new_tokens=12, do_sample=False)
    assert [g[0]["generated_text"] for g in again] == expected[::-1]
    assert pipe.host_pool.reused > 0  # the later calls took the host buffer the first one returned


def test_draft_model_through_the_pipeline():
    tok = tiny_tokenizer()
    prompt = words(120, seed=3)
    dense = pipeline("text-generation", model=tiny_model("llama"), tokenizer=tok)
    expected = dense(prompt, max_new_tokens=10, do_sample=False)[0]["generated_text"]
    pipe = oasis_hf.text_generation_pipeline(tiny_model("llama"), tok, CFG)
    out = pipe(prompt, max_new_tokens=10, do_sample=False, assistant_model=tiny_model("llama", layers=1))
    assert out[0]["generated_text"] == expected


@pytest.mark.parametrize("key", ["past_key_values", "cache"])
def test_a_reused_cache_is_refused(key):
    model = tiny_model("llama")
    pipe = oasis_hf.text_generation_pipeline(model, tiny_tokenizer(), CFG)
    with pytest.raises(UnsupportedError, match="reused across prompts"):
        pipe(words(20, seed=4), max_new_tokens=3, **{key: oasis_hf.OasisCache(model.config, CFG)})
    assert torch.is_grad_enabled()
