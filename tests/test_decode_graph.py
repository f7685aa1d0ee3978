"""`DecodeGraph`: whole-model decode forwards over an OasisCache (captured on CUDA; the same per-layer path runs
eagerly on the CPU, which is what these tests check against ordinary decoding)."""

import pytest
import torch

import oasis_hf
from oasis_hf.decode_graph import DecodeGraph
from oasis_hf.draft import positions
from oasis_hf.errors import UnsupportedError
from oasis_hf.speculative import speculative_generate
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import left_padded

SMALL = dict(budget_tokens=128, max_fetch_blocks=2)  # 8 slots of 16 per (sequence, head): real eviction and fetches


def _decode(model, cache, ids, mask, steps: int, graph: bool, device="cpu", plain_steps=()) -> torch.Tensor:
    """Greedy tokens (B, steps + 1): a prefill forward, then `steps` one-token forwards (through a DecodeGraph or
    plain ``model(...)``; the steps numbered in `plain_steps` plainly either way)."""
    kwarg = oasis_hf.compat.cache_kwarg(model)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{kwarg: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        runner = DecodeGraph(model, cache) if graph else None
        tokens = [token]
        for step in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            pos = positions(mask, 1)
            if runner is not None and step not in plain_steps:
                logits = runner(token, pos)
            else:
                logits = model(input_ids=token, attention_mask=mask, position_ids=pos, use_cache=True,
                               **{kwarg: cache}).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
    return torch.cat(tokens, dim=1)


def _graph_path_matches(model, ids, mask, steps: int, fields: dict, inspect=None) -> dict:
    """Decode `steps` tokens plainly, then through a DecodeGraph, each on a fresh cache of `fields`: asserts the same
    tokens and the same number of blocks fetched; returns the DecodeGraph run's statistics (`inspect(cache)` sees
    its cache before it closes)."""
    with oasis_cache(model, **fields) as cache:
        ref = _decode(model, cache, ids, mask, steps, graph=False)
        ref_fetched = cache.stats.summary()["fetched_blocks"]
        ref_host = _host_rows(cache)
    with oasis_cache(model, **fields) as cache:
        out = _decode(model, cache, ids, mask, steps, graph=True)
        stats = cache.stats.summary()
        host = _host_rows(cache)
        if inspect is not None:
            inspect(cache)
    assert torch.equal(out, ref)
    assert stats["fetched_blocks"] == ref_fetched
    # Every row the steps wrote back reached the host store (the whole-step graph writes them on a side stream);
    # a compiled model's K/V differ from eager ones by rounding only.
    for rows_ref, rows in zip(ref_host, host, strict=True):
        torch.testing.assert_close(rows, rows_ref)
    return stats


def _host_rows(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's K and V rows in the host store, (B, H_kv, L, D) on the CPU, after the device is done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    length = cache.get_seq_length()
    host = cache.host
    return [tuple(t.cpu() for t in host.read_range(layer.layer_idx, length, "cpu")) for layer in cache.oasis_layers]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plain_forwards_between_graph_steps(device):
    """`DecodeGraph` advances the step's position on the device itself and writes it from the host only when a step
    starts elsewhere: plain forwards between its steps (the cache grows without it) and the steps after them
    still decode the tokens of plain decoding (on CUDA: replays of one captured graph)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", attn="oasis", device=device, dtype=dtype)
    ids, mask = left_padded([200, 170], seed=5)
    ids, mask = ids.to(device), mask.to(device)
    fields = dict(SMALL, selector="lookahead")

    def written(cache):  # every layer's keys in the host store: a step at a wrong position writes elsewhere
        if device == "cuda":  # no step waits for the GPU, so the host runs several steps ahead of it: let the
            torch.cuda.synchronize()  # last steps (and their write-backs) finish before reading host memory
        return [cache.host.read_keys(layer.layer_idx, layer.length).float().cpu() for layer in cache.oasis_layers]

    with oasis_cache(model, **fields) as cache:
        ref = _decode(model, cache, ids, mask, 14, graph=False)
        ref_keys = written(cache)
    with oasis_cache(model, **fields) as cache:
        out = _decode(model, cache, ids, mask, 14, graph=True, plain_steps={4, 5, 9})
        keys = written(cache)
        replays = cache.stats.summary()["graph_replays"]
    assert torch.equal(out, ref)
    for got, want in zip(keys, ref_keys, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if device == "cuda":
        assert replays > 0


@pytest.mark.parametrize(("family", "selector"), [("llama", "lookahead"), ("llama", "current-query"),
                                                 ("llama", "static"), ("qwen2", "lookahead"), ("qwen3", "lookahead")])
def test_whole_step_path_equals_ordinary_decoding(family, selector):
    """Below-context budget, left padding, a store that grows while decoding: the whole-step path (the per-layer
    part a DecodeGraph captures) picks, fetches and attends exactly as ordinary decoding does."""
    model = tiny_model(family, attn="oasis")
    ids, mask = left_padded([200, 170], seed=3)
    fields = dict(SMALL, selector=selector, host_growth_tokens=16)

    def inspect(cache):
        for layer in cache.oasis_layers:
            layer.table.check()
            assert layer.length == 200 + 20
        assert cache.host.capacity_blocks > 13, "the store should have grown while decoding"

    stats = _graph_path_matches(model, ids, mask, 20, fields, inspect)
    assert stats["decode_layer_steps"] == 20 * 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("selector", "sync"), [("lookahead", 0), ("current-query", 0), ("lookahead", 2)])
def test_whole_step_path_with_layer_budgets_equals_ordinary_decoding(selector, sync, device):
    """Layers of different budgets (`layer_budget_tokens`: 8, 16 and 12 slots): the whole-step path, on CUDA
    replayed graphs of differently sized pools, picks, fetches and attends as ordinary decoding does (with
    `sync_fetch_blocks`, the in-step correction of the background selection too)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", layers=3, attn="oasis", device=device, dtype=dtype)
    ids, mask = left_padded([230, 200], seed=7)
    ids, mask = ids.to(device), mask.to(device)
    fields = dict(SMALL, selector=selector, layer_budget_tokens={1: 256, 2: 192}, sync_fetch_blocks=sync)

    def inspect(cache):
        assert [layer.pool_k.shape[2] for layer in cache.oasis_layers] == [8, 16, 12]
        for layer in cache.oasis_layers:
            layer.table.check()

    stats = _graph_path_matches(model, ids, mask, 24, fields, inspect)
    assert stats["fetched_blocks"] > 0
    if device == "cuda":
        assert stats["graph_replays"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("selector", ["lookahead", "previous-query"])
def test_selection_interval_spaces_the_jobs_alike_on_both_paths(selector, device):
    """`selection_interval=3`: a layer's selection job follows decode forwards 0, 3, 6, ... only. The whole-step
    path (on CUDA one captured graph with the jobs and one without) picks, fetches and attends as ordinary decoding
    does, with a third of the jobs, and moves fewer blocks than a job after every forward."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", attn="oasis", device=device, dtype=dtype)
    ids, mask = left_padded([230, 200], seed=11)
    ids, mask = ids.to(device), mask.to(device)
    steps = 20
    every = _graph_path_matches(model, ids, mask, steps, dict(SMALL, selector=selector))
    spaced = _graph_path_matches(model, ids, mask, steps, dict(SMALL, selector=selector, selection_interval=3))
    assert every["prefetch_jobs"] == steps * 2
    assert spaced["prefetch_jobs"] == len(range(0, steps, 3)) * 2
    assert 0 < spaced["fetched_blocks"] < every["fetched_blocks"]
    if device == "cuda":
        assert spaced["graph_replays"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_keep_margin_moves_fewer_blocks_alike_on_both_paths(device):
    """`keep_margin=0.01` (hysteresis of the plan; the tiny random model's block scores lie close together, so a
    small margin already keeps most of them): the whole-step path (on CUDA the plan kernel inside the captured job)
    picks, fetches and attends as ordinary decoding does, and moves fewer blocks than plain top blocks."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", attn="oasis", device=device, dtype=dtype)
    ids, mask = left_padded([230, 200], seed=11)
    ids, mask = ids.to(device), mask.to(device)
    plain = _graph_path_matches(model, ids, mask, 20, dict(SMALL, selector="lookahead"))
    kept = _graph_path_matches(model, ids, mask, 20, dict(SMALL, selector="lookahead", keep_margin=0.01))
    assert 0 < kept["fetched_blocks"] < plain["fetched_blocks"]


@pytest.mark.gpu
def test_compiled_whole_step_graphs_verify_drafts_on_cuda():
    """compile_model with speculative verification: forwards of several T (a captured graph each, every T warmed
    up twice before its capture, so no capture compiles) give the tokens of the uncompiled whole-step path."""
    import torch._dynamo

    torch._dynamo.reset()
    target = tiny_model("llama", layers=2, attn="oasis", device="cuda")
    ids, mask = left_padded([200, 150, 180], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    outs = []
    try:
        for compiled in (False, True):
            with oasis_cache(target, selector="lookahead", compile_model=compiled, **SMALL) as cache:
                outs.append(speculative_generate(target, tiny_model("qwen2", layers=1, device="cuda"), ids, mask,
                                                 cache=cache, max_new_tokens=24, num_draft_tokens=3,
                                                 target_graphs=True).sequences)
                if compiled:
                    assert cache.stats.graph_replays > 0
    finally:
        torch._dynamo.reset()
    assert torch.equal(outs[0], outs[1])


def test_speculative_rounds_through_decode_graph_equal_the_plain_loop():
    """Verify forwards of T = k + 1 through a DecodeGraph, cropped after each round: the same tokens as the plain
    loop with inline jobs (budget below the context, lookahead jobs in every layer). Inline, because with the worker
    thread a job still queued at the crop is narrowed to the accepted queries, which depends on timing; a whole-step
    job runs inside the forward and scores with all of them, as an inline one does."""
    target = tiny_model("llama", layers=2, attn="oasis")
    ids, mask = left_padded([200, 150, 180], seed=4)
    outs = []
    for graphs in (False, True):
        cache = oasis_cache(target, selector="lookahead", prefetch=graphs, **SMALL)
        outs.append(speculative_generate(target, tiny_model("qwen2", layers=1), ids, mask, cache=cache,
                                         max_new_tokens=24, num_draft_tokens=3, target_graphs=graphs).sequences)
        cache.close()
    assert torch.equal(outs[0], outs[1])


def test_decode_graph_refuses_what_it_cannot_capture():
    gemma = tiny_model("gemma3", attn="oasis")
    with pytest.raises(UnsupportedError, match="sliding-window"):
        DecodeGraph(gemma, oasis_cache(gemma))
    model = tiny_model("llama", attn="oasis")
    with pytest.raises(UnsupportedError, match="prefetch_policy"):
        DecodeGraph(model, oasis_cache(model, selector="lookahead", prefetch_policy="stale"))
    with pytest.raises(UnsupportedError, match="measure_recall"):
        DecodeGraph(model, oasis_cache(model, measure_recall=True))
    with pytest.raises(UnsupportedError, match="OasisCache"):
        DecodeGraph(model, None)
    cache = oasis_cache(model)
    runner = DecodeGraph(model, cache)
    with pytest.raises(UnsupportedError, match="prefill"):
        runner(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    del cache  # a DecodeGraph holds its cache weakly: without another reference it is gone
    with pytest.raises(UnsupportedError, match="garbage-collected"):
        runner(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["lookahead", "current-query"])
def test_decode_graph_replays_on_cuda_and_stays_exact(selector):
    """On CUDA the third call of a T is a replay of the whole forward: tokens equal ordinary decoding (bf16, budget
    below the context, a store that grows while decoding, so graphs are recaptured at the new table size)."""
    model = tiny_model("llama", attn="oasis", device="cuda", dtype=torch.bfloat16)
    ids, mask = left_padded([300, 260], seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    # Same tokens and the same blocks moved: a job forked onto the prefetch stream inside the graph once read its
    # step's queries after the next layers had reused their memory (other blocks fetched; tokens sometimes changed).
    stats = _graph_path_matches(model, ids, mask, 40, dict(SMALL, selector=selector, host_growth_tokens=64))
    assert stats["graph_replays"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_model_in_the_whole_step_path_decodes_the_same_tokens(device):
    """OasisConfig.compile_model: the model's modules through torch.compile (each layer's update and attention one
    opaque operator; on CUDA two eager calls compile, the third captures without compiling, later ones replay) pick,
    fetch and decode as ordinary decoding does (float32, so that Inductor's fused rounding cannot flip a token)."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model("llama", attn="oasis", device=device)
    ids, mask = left_padded([180, 150], seed=6)
    ids, mask = ids.to(device), mask.to(device)
    steps = 12 if device == "cuda" else 3  # the CPU compiles the mask frames again at every eager call
    stats = _graph_path_matches(model, ids, mask, steps, dict(SMALL, selector="lookahead", compile_model=True))
    if device == "cuda":
        assert stats["graph_replays"] > 0
    torch._dynamo.reset()


def test_compiled_whole_step_forward_traces_as_one_graph():
    """compile_model: inside a DecodeGraph forward each layer's cache update and attention are one opaque operator
    (`oasis_hf.cache.step_op`), so torch.compile traces the decode forward without a graph break: two graphs in all
    (the first call's, and its recompilation with the step's position dynamic) for any number of layers."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        model = tiny_model("llama", layers=3, attn="oasis")
        ids, mask = left_padded([180, 150], seed=6)
        with oasis_cache(model, selector="lookahead", compile_model=True, **SMALL) as cache:
            _decode(model, cache, ids, mask, 3, graph=True)
            assert cache.compiled_step is False  # only while a compiled forward runs
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] <= 2  # in pieces: a frame per layer and break, more
    finally:
        torch._dynamo.reset()


def test_compiled_whole_step_refuses_a_model_that_drops_attention_keywords():
    """A model whose forward does not pass its keywords down to the attention function would attend over the step's
    new tokens alone under compile_model (its cache update is deferred to the attention's operator): refused."""
    import torch._dynamo

    from oasis_hf.cache.step_op import STEP_KWARG

    torch._dynamo.reset()
    try:
        model = tiny_model("llama", layers=2, attn="oasis")
        attention = model.model.layers[0].self_attn
        forward = attention.forward

        def dropping(*args, **kwargs):
            kwargs.pop(STEP_KWARG, None)
            return forward(*args, **kwargs)

        attention.forward = dropping
        ids, mask = left_padded([120, 100], seed=2)
        with oasis_cache(model, compile_model=True, **SMALL) as cache:
            with pytest.raises(UnsupportedError, match=STEP_KWARG):
                _decode(model, cache, ids, mask, 1, graph=True)
            assert cache.compiled_step is False
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_a_later_compiled_cache_of_a_settled_shape_warms_up_once():
    """compile_model: the first cache's runner warms a shape up twice (compile, then recompile with the position
    dynamic) before its capture; the next cache of the same shape (the next generate call) needs one eager call,
    since that call compiles nothing, and decodes the same tokens."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model("llama", attn="oasis", device="cuda")
    ids, mask = (t.cuda() for t in left_padded([180, 150], seed=6))
    outs, eager = [], []
    try:
        for _ in range(3):
            with oasis_cache(model, selector="lookahead", compile_model=True, **SMALL) as cache:
                outs.append(oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=8))
                stats = cache.stats
                eager.append((stats.decode_layer_steps - stats.graph_replays) // len(cache.oasis_layers))
    finally:
        torch._dynamo.reset()
    assert eager == [2, 1, 1]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("selector", ["lookahead", "current-query"])
def test_decode_generate_equals_generate_on_the_same_cache_config(selector, device):
    """`decode_generate` (every step through a DecodeGraph) gives the tokens of `model.generate` on an OasisCache of
    the same config: left padding, a below-context budget, and EOS (a sequence that ends is padded after it; the
    second run adds a second EOS id that ends another sequence early). On CUDA the steps are graph replays."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", attn="oasis", device=device, dtype=dtype)
    ids, mask = (t.to(device) for t in left_padded([150, 120, 135], seed=9))
    fields = dict(SMALL, selector=selector)
    eos = [model.generation_config.eos_token_id]

    def reference(eos_ids):
        with oasis_cache(model, **fields) as cache, torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=16,
                                  do_sample=False, pad_token_id=0, eos_token_id=eos_ids)

    ref = reference(eos)
    with oasis_cache(model, **fields) as cache:
        out = oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=16, eos_token_id=eos,
                                       pad_token_id=0)
    assert torch.equal(out, ref)
    extra = eos + [int(ref[1, ids.shape[1] + 5])]  # sequence 1's sixth new token ends it there
    ref = reference(extra)
    assert bool((ref[1, ids.shape[1] + 6:] == 0).all())
    with oasis_cache(model, **fields) as cache:
        out = oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=16, eos_token_id=extra,
                                       pad_token_id=0)
    assert torch.equal(out, ref)
    # Every sequence ends by its sixth token: the loop stops there, and the step it queued before it saw that is
    # dropped again (the cache holds the prompt and every new token but the last, as after generate).
    every = eos + [int(t) for t in ref[:, ids.shape[1] + 5]]
    ref = reference(every)
    with oasis_cache(model, **fields) as cache:
        out = oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=16, eos_token_id=every,
                                       pad_token_id=0)
        assert out.shape[1] < ids.shape[1] + 16 and cache.get_seq_length() == out.shape[1] - 1
    assert torch.equal(out, ref)


def test_decode_generate_refuses_bad_input():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([40], seed=1)
    with oasis_cache(model) as cache:
        with pytest.raises(ValueError, match="max_new_tokens"):
            oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=0)
        with pytest.raises(ValueError, match="temperature"):
            oasis_hf.decode_generate(model, ids, mask, cache=cache, do_sample=True, temperature=0)
        oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=2)
        with pytest.raises(UnsupportedError, match="empty OasisCache"):
            oasis_hf.decode_generate(model, ids, mask, cache=cache, max_new_tokens=2)
