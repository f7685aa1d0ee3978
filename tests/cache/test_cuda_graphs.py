"""The decode step captured in CUDA graphs gives the same results as the eager step (GPU only). These are the
per-layer step graphs: every cache here has ``whole_step=False`` (the whole-model graph path that `enable` installs
is tested in test_fast_path and test_decode_graph)."""

import pytest
import torch
from transformers import DynamicCache

from tests._factories import oasis_cache as _oasis_cache
from tests._factories import tiny_model
from tests.test_generate import generate, left_padded

pytestmark = pytest.mark.gpu


def oasis_cache(model, **fields):
    return _oasis_cache(model, whole_step=False, **fields)


def _teacher_forced(model, cache, ids, prompt):
    out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_under_selection(family, dtype):
    """Small budget (real eviction and fetches), many steps across block boundaries, left padding."""
    model = tiny_model(family, attn="oasis", device="cuda", dtype=dtype)
    ids, mask = left_padded([300, 260])
    ids, mask = ids.cuda(), mask.cuda()
    small = dict(budget_tokens=128, max_fetch_blocks=2)
    eager_cache = oasis_cache(model, cuda_graphs=False, **small)
    graph_cache = oasis_cache(model, cuda_graphs=True, **small)
    with torch.inference_mode():
        ref = model.generate(input_ids=ids, attention_mask=mask, past_key_values=eager_cache, max_new_tokens=40,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=graph_cache, max_new_tokens=40,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=0, rtol=0)
    stats, ref_stats = graph_cache.stats.summary(), eager_cache.stats.summary()
    assert stats["graph_replays"] > 0 and ref_stats["graph_replays"] == 0
    assert stats["fetched_blocks"] == ref_stats["fetched_blocks"] > 0
    for layer in graph_cache.oasis_layers:
        layer.table.check()


@pytest.mark.parametrize("summary", [{}, dict(summary="quantized", quantized_rerank=1)], ids=["mean", "two-stage"])
@pytest.mark.parametrize("selector", ["current-query", "lookahead"])
def test_graph_replay_equals_eager_with_prefill_window_and_score_memory(selector, summary):
    """The selection memory is updated in place inside the captured step (current-query) or job (lookahead); with
    two-stage quantized scoring (about 10 of 22 blocks' codes read: S = 4 slots beyond sinks and recent window) the
    candidates' top-k and marks are captured too."""
    model = tiny_model("llama", attn="oasis", device="cuda", dtype=torch.bfloat16)
    ids, mask = left_padded([300, 260])
    ids, mask = ids.cuda(), mask.cuda()
    small = dict(selector=selector, budget_tokens=128, max_fetch_blocks=2, prefill_window_tokens=16, score_decay=0.8,
                 **summary)
    outs, stats = [], []
    for graphs in (False, True):
        with oasis_cache(model, cuda_graphs=graphs, **small) as cache, torch.inference_mode():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40,
                                       do_sample=False, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True))
            stats.append(cache.stats.summary())
            assert float(cache.oasis_layers[0].score_memory.abs().sum()) > 0
    assert torch.equal(outs[1].sequences, outs[0].sequences)
    torch.testing.assert_close(torch.stack(outs[1].logits), torch.stack(outs[0].logits), atol=0, rtol=0)
    assert stats[1]["graph_replays"] > 0 and stats[1]["fetched_blocks"] == stats[0]["fetched_blocks"] > 0


def test_graphs_with_drafts_crop_and_reset():
    """Assisted generation (T varies, rejected drafts cropped) equals dense; the cache is reusable after reset."""
    ids, mask = left_padded([120])
    ids, mask = ids.cuda(), mask.cuda()
    draft = tiny_model("llama", layers=1, device="cuda")
    draft.generation_config.num_assistant_tokens = 5
    dense = tiny_model("llama", device="cuda")
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    model = tiny_model("llama", attn="oasis", device="cuda")
    cache = oasis_cache(model)
    out = generate(model, ids, mask, cache, assistant_model=draft)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1
    assert cache.stats.summary()["graph_replays"] > 0
    cache.reset()
    again = generate(model, ids, mask, cache, assistant_model=draft)
    assert torch.equal(again, ref)


def test_teacher_forced_graph_steps_match_eager_bf16():
    model = tiny_model("qwen2", attn="oasis", device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(1, 128, (3, 220), generator=torch.Generator().manual_seed(3)).cuda()
    small = dict(budget_tokens=96, max_fetch_blocks=1)
    with torch.inference_mode():
        ref = _teacher_forced(model, oasis_cache(model, cuda_graphs=False, **small), ids, 150)
        out = _teacher_forced(model, oasis_cache(model, **small), ids, 150)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


@pytest.mark.parametrize("selector", ["lookahead", "previous-query"])
def test_prefetch_on_worker_stream_equals_inline(selector):
    """Graph-captured steps plus selection jobs on the worker stream, launched from the caller (graph jobs) or
    handed to the worker thread, with a capped or uncapped gather: same output as inline jobs."""
    model = tiny_model("llama", attn="oasis", device="cuda", dtype=torch.bfloat16)
    ids, mask = left_padded([300, 260])
    ids, mask = ids.cuda(), mask.cuda()
    draft = tiny_model("llama", layers=1, device="cuda", dtype=torch.bfloat16)
    outs, stats = [], []
    variants = [dict(prefetch=False), dict(prefetch=True), dict(prefetch=True, prefetch_launch="thread"),
                dict(prefetch=True, fetch_programs=1), dict(prefetch=True, fetch_programs=None)]
    for fields in variants:
        with oasis_cache(model, selector=selector, budget_tokens=128, max_fetch_blocks=2, **fields) as c:
            outs.append(generate(model, ids, mask, c))
            stats.append(c.stats.summary())
            for layer in c.oasis_layers:
                layer.table.check()
    for out, stat in zip(outs[1:], stats[1:], strict=True):
        assert torch.equal(outs[0], out)
        assert stats[0]["fetched_blocks"] == stat["fetched_blocks"] > 0
        assert stat["graph_replays"] > 0
    with oasis_cache(model, selector=selector, budget_tokens=128, max_fetch_blocks=2) as c:
        generate(model, ids[:1], mask[:1], c, assistant_model=draft)  # T varies: one graph per T, jobs in between
        assert c.stats.summary()["prefetch_jobs"] > 0


@pytest.mark.parametrize("selector", ["current-query", "lookahead"])
def test_graphs_recaptured_after_the_host_store_grows(selector):
    """The store grows while decoding (tables reallocated, graphs dropped): each T's step and job run eagerly at the
    new table size before their next capture (kernels specialised on it compile outside the capture), and the
    output still equals eager decoding."""
    model = tiny_model("llama", attn="oasis", device="cuda")
    ids, mask = left_padded([200, 170])
    ids, mask = ids.cuda(), mask.cuda()
    fields = dict(selector=selector, budget_tokens=128, max_fetch_blocks=2, host_growth_tokens=16)
    with oasis_cache(model, cuda_graphs=False, **fields) as eager:
        ref = generate(model, ids, mask, eager)
    with oasis_cache(model, **fields) as cache:
        out = generate(model, ids, mask, cache)
        assert cache.host.capacity_blocks > 13, "the store did not grow while decoding"
        assert cache.stats.summary()["graph_replays"] > 0
    assert torch.equal(out, ref)
