"""Lookahead / previous-query selection with the background prefetcher (CPU; the GPU twin is in test_cuda_graphs)."""

import gc
import threading
import time

import pytest
import torch
from transformers import DynamicCache

from oasis_hf import PrefetchError
from oasis_hf.cache.prefetch import Prefetcher
from oasis_hf.cache.selection_jobs import SelectionJobs
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded

SMALL = dict(budget_tokens=128, max_fetch_blocks=2)  # 8 slots per (sequence, head): real eviction and fetches


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("oasis-prefetch")]


@pytest.mark.parametrize("selector", ["lookahead", "previous-query"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefetch_on_off_identical(selector, family):
    model = tiny_model(family, attn="oasis")
    ids, mask = left_padded([300, 260])
    outs, stats = [], []
    for prefetch in (False, True):
        with oasis_cache(model, selector=selector, prefetch=prefetch, **SMALL) as cache:
            outs.append(generate(model, ids, mask, cache))
            stats.append(cache.stats.summary())
            for layer in cache.oasis_layers:
                layer.table.check()
                assert int(layer.table.resident_count().max()) <= 8
    assert torch.equal(outs[0], outs[1])
    assert stats[0]["fetched_blocks"] == stats[1]["fetched_blocks"] > 0
    assert stats[1]["prefetch_jobs"] == stats[0]["prefetch_jobs"] > 0
    assert not prefetch_threads()


def test_lookahead_budget_covering_context_matches_dense_with_drafts_and_prompt_lookup():
    ids, mask = left_padded([150])
    dense = tiny_model("llama")
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    model = tiny_model("llama", attn="oasis")
    draft = tiny_model("llama", layers=1)
    draft.generation_config.num_assistant_tokens = 4
    with oasis_cache(model, selector="lookahead") as cache:
        assert torch.equal(generate(model, ids, mask, cache, assistant_model=draft), ref)
    with oasis_cache(model, selector="lookahead") as cache:
        assert torch.equal(generate(model, ids, mask, cache, prompt_lookup_num_tokens=3), ref)


def test_lookahead_selects_with_the_draft_queries():
    """With drafts, the job scores with all T queries of the verification forward, not only the first."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300])
    draft = tiny_model("llama", layers=1)
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"  # keep T = 5 although drafts are rejected
    draft.generation_config.assistant_confidence_threshold = 0.0  # and although the random draft is unsure
    seen = []
    original = SelectionJobs.job

    def spy(self, query, start, num_tokens, scale):
        seen.append(self.layer.cache.selector.lookahead_queries(query).shape[2])
        return original(self, query, start, num_tokens, scale)

    SelectionJobs.job = spy
    try:
        for selector in ("lookahead", "previous-query"):
            seen.clear()
            with oasis_cache(model, selector=selector, **SMALL) as cache:
                generate(model, ids, mask, cache, assistant_model=draft)
            assert max(seen) == (5 if selector == "lookahead" else 1)
    finally:
        SelectionJobs.job = original


def slow_jobs(monkeypatch, seconds: float) -> None:
    """Make every selection job sleep `seconds` first, so the layer's next step finds it unfinished."""
    original = SelectionJobs.job

    def slow(self, *args):
        time.sleep(seconds)
        return original(self, *args)

    monkeypatch.setattr(SelectionJobs, "job", slow)


def test_slow_prefetcher_changes_nothing_but_late_count(monkeypatch):
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([260])
    with oasis_cache(model, selector="lookahead", **SMALL) as cache:
        ref = generate(model, ids, mask, cache)
        fast = cache.stats.summary()
    slow_jobs(monkeypatch, 0.01)
    with oasis_cache(model, selector="lookahead", **SMALL) as cache:
        out = generate(model, ids, mask, cache)
        late = cache.stats.summary()
    assert torch.equal(out, ref)
    assert late["fetched_blocks"] == fast["fetched_blocks"]
    assert late["prefetch_late"] > 0 and late["prefetch_stall_s"] > 0


def test_worker_exception_surfaces_in_the_caller(monkeypatch):
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([200])
    calls = []
    original = SelectionJobs.job

    def broken(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return original(self, *args)

    monkeypatch.setattr(SelectionJobs, "job", broken)
    cache = oasis_cache(model, selector="lookahead", **SMALL)
    with pytest.raises(PrefetchError, match="injected failure") as err:
        generate(model, ids, mask, cache)
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(PrefetchError):
        cache.close()  # the outstanding job's error is reported again ...
    assert not prefetch_threads()  # ... and the worker is gone all the same
    cache.close()  # idempotent


def test_close_is_idempotent_and_no_thread_outlives_the_cache():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([200])
    cache = oasis_cache(model, selector="lookahead", **SMALL)
    generate(model, ids, mask, cache)
    assert len(prefetch_threads()) == 1
    cache.close()
    cache.close()
    assert not prefetch_threads()
    forgotten = oasis_cache(model, selector="lookahead", **SMALL)  # never closed: collected, thread stops
    generate(model, ids, mask, forgotten)
    assert len(prefetch_threads()) == 1
    del forgotten  # freed by reference counting: no cycle keeps it (next test)
    assert not prefetch_threads()


def test_a_forgotten_cache_is_freed_and_stops_its_worker_without_the_cycle_collector():
    """No reference cycles between the cache, its layers and its stats: a cache dropped without close() is freed by
    reference counting alone and its worker thread is joined, call after call, with the cyclic collector paused (a
    loop of generate calls would otherwise gather one live thread per cache until a full collection)."""
    import weakref

    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([120])
    gc.collect()
    gc.disable()
    try:
        for _ in range(15):
            cache = oasis_cache(model, selector="lookahead", **SMALL)
            generate(model, ids, mask, cache)
            assert cache.stats.summary()["prefetch_jobs"] > 0  # the worker ran
            alive = weakref.ref(cache)
            del cache
            assert alive() is None
            assert not prefetch_threads()
    finally:
        gc.enable()


def test_prefetcher_lifecycle_alone():
    with Prefetcher(torch.device("cpu")) as worker:
        box = []
        ticket = worker.submit(lambda: box.append(1))
        worker.wait(ticket)
        assert box == [1] and worker.alive
        assert ticket.queue_wait_s >= 0 and ticket.run_s >= 0  # host timings of the job (stats sum them)
        with pytest.raises(PrefetchError, match="needs a CUDA device"):
            worker.launch(lambda: None)  # launching on the caller's thread is a CUDA-stream path only
    assert not worker.alive
    worker.close()
    with pytest.raises(PrefetchError, match="closed"):
        worker.submit(lambda: None)
    with pytest.raises(PrefetchError, match="closed"):
        worker.launch(lambda: None)


def test_forgotten_cache_does_not_hang_interpreter_exit():
    import subprocess
    import sys

    code = (
        "from tests._factories import oasis_cache, tiny_model\n"
        "from tests.test_generate import generate, left_padded\n"
        "m = tiny_model('llama', attn='oasis'); ids, mask = left_padded([120])\n"
        "cache = oasis_cache(m, selector='lookahead', budget_tokens=128, max_fetch_blocks=2)\n"
        "generate(m, ids, mask, cache)\n"  # never closed, still referenced at exit
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_jobs_run_under_the_callers_inference_mode():
    """Grad modes are thread-local: tensors made under inference_mode must still be updatable by the worker."""
    model = tiny_model("llama", attn="oasis")
    ids = torch.randint(1, 128, (2, 200), generator=torch.Generator().manual_seed(4))
    logits = []
    for prefetch in (False, True):
        with torch.inference_mode(), oasis_cache(model, selector="lookahead", prefetch=prefetch, **SMALL) as cache:
            model(ids, past_key_values=cache, use_cache=True)
            for t in range(10):
                logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(logits[:10]), torch.cat(logits[10:]), atol=0, rtol=0)


def test_recall_measurement():
    """Budget covering the context: everything resident, recall 1. Small budget: oracle keeps the most mass,
    StreamingLLM-style static the least; lookahead is measured the same way."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300])
    recall = {}
    for selector, fields in [("lookahead", {}), ("oracle", SMALL), ("static", SMALL), ("lookahead", SMALL)]:
        with oasis_cache(model, selector=selector, measure_recall=True, **fields) as cache:
            generate(model, ids, mask, cache)
            stats = cache.stats.summary()
        assert stats["recall_steps"] == stats["decode_layer_steps"] > 0
        assert 0 < stats["mass_recall"] <= 1 + 1e-6 and 0 < stats["topk_recall"] <= 1
        recall[(selector, bool(fields))] = stats["mass_recall"]
    assert recall[("lookahead", False)] == pytest.approx(1.0)
    assert recall[("oracle", True)] > recall[("lookahead", True)] > recall[("static", True)]


def test_prefetch_with_host_growth_keeps_tables_consistent(monkeypatch):
    """The host store grows during decoding (the block maps are reallocated) while slow jobs are queued; the
    cache waits for them first. (A regression check: the race itself is not forced deterministically here.)"""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([200])
    fields = dict(SMALL, host_growth_tokens=16)
    with oasis_cache(model, selector="lookahead", prefetch=False, **fields) as cache:
        ref = generate(model, ids, mask, cache)
        grown = cache.host.capacity_blocks
    assert grown > 13  # 200 prompt tokens fill 13 blocks of 16: the store grew while decoding
    slow_jobs(monkeypatch, 0.005)
    with oasis_cache(model, selector="lookahead", **fields) as cache:
        out = generate(model, ids, mask, cache)
        for layer in cache.oasis_layers:
            layer.table.check()
    assert torch.equal(out, ref)


def test_growth_and_reallocation_send_each_query_length_back_to_an_eager_warm_up():
    """After the tables grow (or a reset cache reallocates for another batch size, or a reset follows an
    interrupted forward) no step or job of any T is captured before it ran eagerly again at the new size: a CUDA
    graph capture must not be the first run of a kernel variant (it would compile inside). A plain reset keeps the
    buffers, so it keeps what ran."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([60])
    with oasis_cache(model, selector="lookahead") as cache:
        generate(model, ids, mask, cache)
        layer = cache.oasis_layers[0]
        layer.step_graphs.warm.update({1, 5})
        layer.jobs.warm.update({1, 5})
        layer.grow(layer.table.capacity_blocks + 8)
        assert not layer.step_graphs.warm and not layer.jobs.warm
        layer.step_graphs.warm.add(1)
        layer.jobs.warm.add(1)
        cache.reset()
        assert layer.step_graphs.warm == {1} and layer.jobs.warm == {1}
        ids2, mask2 = left_padded([60, 50])
        generate(model, ids2, mask2, cache)  # batch 2: reallocated
        assert layer.batch_size == 2 and 1 not in layer.jobs.warm
        layer.step_graphs.warm.add(7)
        layer._pending = ("whole-step", 0, 1)  # as a forward interrupted before this layer's attention leaves it
        cache.reset()
        assert not layer.step_graphs.warm and not layer.jobs.warm


@pytest.mark.parametrize("drop", [True, False])
def test_rejected_drafts_are_dropped_from_jobs_not_started(monkeypatch, drop):
    """A verification forward of 4 tokens, 2 of them rejected (crop): queued jobs score with the 2 accepted queries
    only when drop_rejected_drafts is on. With the budget covering the context the next step equals that of a cache
    that never saw the rejected tokens (narrowing changes which blocks are chosen, never exactness)."""
    seen: list[int] = []
    original = SelectionJobs.job

    def recording(self, query, start, num_tokens, scale):
        time.sleep(0.02)  # the worker lags, so the crop finds most jobs queued
        seen.append(num_tokens)
        return original(self, query, start, num_tokens, scale)

    monkeypatch.setattr(SelectionJobs, "job", recording)
    model = tiny_model("llama", attn="oasis", layers=4)
    ids = torch.randint(1, 128, (1, 210), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode(), oasis_cache(model, selector="lookahead", drop_rejected_drafts=drop) as cache:
        model(ids[:, :200], past_key_values=cache, use_cache=True)
        model(ids[:, 200:204], past_key_values=cache, use_cache=True)  # 1 accepted + 3 drafts
        cache.crop(-2)  # the last 2 drafts rejected
        after = model(ids[:, 202:203], past_key_values=cache, use_cache=True).logits
        narrowed = cache.stats.summary()["narrowed_jobs"]
    with torch.inference_mode(), oasis_cache(model, selector="lookahead") as plain:
        model(ids[:, :200], past_key_values=plain, use_cache=True)
        model(ids[:, 200:202], past_key_values=plain, use_cache=True)
        expected = model(ids[:, 202:203], past_key_values=plain, use_cache=True).logits
    if drop:
        assert narrowed >= 2 and seen[:4].count(2) == narrowed  # the verify forward's jobs, layer by layer
    else:
        assert narrowed == 0 and seen[:4] == [4, 4, 4, 4]
    torch.testing.assert_close(after, expected)


def _table_is_consistent(cache) -> None:
    for layer in cache.oasis_layers:
        table = layer.table
        slots = table.slot_block[..., : table.num_slots]
        for b in range(slots.shape[0]):
            for h in range(slots.shape[1]):
                resident = [int(x) for x in slots[b, h] if x >= 0]
                assert len(resident) == len(set(resident)), "a block is resident twice"
                for slot, block in enumerate(slots[b, h].tolist()):
                    if block >= 0:
                        assert int(table.block_slot[b, h, block]) == slot


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_stale_policy_inline_equals_wait(family):
    """With jobs inline every proposal is finished at the next step, so committing it then (stale) must give
    exactly what applying it right away (wait) gives."""
    model = tiny_model(family, attn="oasis")
    ids, mask = left_padded([260, 200])
    outs = []
    for policy in ("wait", "stale"):
        with oasis_cache(model, selector="lookahead", prefetch=False, prefetch_policy=policy, **SMALL) as cache:
            outs.append(model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30,
                                       do_sample=False, pad_token_id=0, output_logits=True,
                                       return_dict_in_generate=True))
            stats = cache.stats.summary()
        assert stats["fetched_blocks"] > 0 and stats["stale_steps"] == 0
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    torch.testing.assert_close(torch.stack(outs[0].logits), torch.stack(outs[1].logits), atol=0, rtol=0)


@pytest.mark.parametrize("budget", [4096, 128], ids=["budget-covers-context", "small-budget"])
def test_stale_policy_does_not_wait_for_a_slow_worker(monkeypatch, budget):
    """A worker slower than the steps: stale steps run on what is resident (counted) instead of stalling, the table
    stays consistent, and with the budget covering the context the output is dense's. (The cache still waits for
    its jobs before the host store grows and when the stats are read.)"""
    slow_jobs(monkeypatch, 0.01)
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([260, 200])
    fields = dict(SMALL, budget_tokens=budget, host_capacity_tokens=1024)  # no growth during the run
    stalls = {}
    for policy in ("wait", "stale"):
        with oasis_cache(model, selector="lookahead", prefetch_policy=policy, **fields) as cache:
            out = generate(model, ids, mask, cache)
            stalls[policy] = cache.stats.prefetch_stall_s  # before summary() drains the last jobs
            stats = cache.stats.summary()
            _table_is_consistent(cache)
    assert stats["stale_steps"] > 0
    assert stalls["stale"] < stalls["wait"] / 4, stalls
    if budget == 4096:
        assert torch.equal(out, generate(tiny_model("llama"), ids, mask, DynamicCache(config=model.config)))
