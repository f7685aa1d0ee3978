"""OasisCache inside `model.generate` on tiny random Llama / Qwen2 / Qwen3 / Gemma3 models."""

import pytest
import torch
from transformers import DynamicCache

import oasis_hf
from oasis_hf import HostMemoryError, OasisCache, UnsupportedError
from tests._factories import VOCAB, oasis_cache, tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3"]


def left_padded(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[i, width - n :] = 1
    return ids, mask


def generate(model, ids, mask, cache, **kw):
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=24,
                          do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lengths", [[150], [150, 97, 131]], ids=["batch1", "batch3-leftpad"])
def test_budget_covering_context_matches_dense(family, lengths):
    ids, mask = left_padded(lengths)
    dense = tiny_model(family)
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    model = tiny_model(family, attn="oasis")
    cache = oasis_cache(model)
    out = generate(model, ids, mask, cache)
    assert torch.equal(out, ref), f"{family}: greedy tokens differ from DynamicCache + SDPA"
    for layer in cache.oasis_layers:
        layer.table.check()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_logits_match_dense_within_tolerance(family):
    ids, mask = left_padded([140, 90])
    dense, model = tiny_model(family), tiny_model(family, attn="oasis")
    ref = dense.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True,
                         past_key_values=DynamicCache(config=dense.config))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True, past_key_values=oasis_cache(model))
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_assisted_generation_matches_dense(family):
    ids, mask = left_padded([120])
    draft = tiny_model("llama", layers=1)
    draft.generation_config.num_assistant_tokens = 5
    dense = tiny_model(family)
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    model = tiny_model(family, attn="oasis")
    cache = oasis_cache(model)
    out = generate(model, ids, mask, cache, assistant_model=draft)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1  # crop() after rejected drafts kept the cache consistent


def test_cache_keyword_spelling():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100])
    ref = generate(model, ids, mask, oasis_cache(model))
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, cache=oasis_cache(model), max_new_tokens=24,
                             do_sample=False, pad_token_id=0)
    except ValueError as exc:  # transformers < 5.2x has no `cache=` spelling
        pytest.skip(f"this transformers has no cache= argument: {exc}")
    assert torch.equal(out, ref)


def test_small_budget_stays_within_budget_and_runs_kernel_path():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300, 260])
    cache = oasis_cache(model, budget_tokens=128, max_fetch_blocks=2)
    out = generate(model, ids, mask, cache)
    assert out.shape == (2, 324)
    for layer in cache.oasis_layers:
        layer.table.check()
        assert int(layer.table.resident_count().max()) <= 8
        assert layer.pool_k.shape[2] == 8  # the GPU side never holds more than budget_tokens per (seq, head)
    assert cache.device_nbytes() < cache.dense_nbytes()
    stats = cache.stats.summary()
    assert 0 < stats["fetched_blocks_per_layer_step"] <= 2 * 2 * 2  # cap x heads x batch


def _teacher_forced_logits(model, cache, ids, prompt):
    """Prefill `prompt` tokens, then feed the rest one token at a time; returns (steps, V) logits."""
    out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.cat(out)


def _sharp_llama(attn: str):
    """A tiny Llama whose attention is sharpened so that a few blocks carry the mass, as in trained models."""
    model = tiny_model("llama", attn=attn)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    return model


def test_selection_matters_oracle_close_static_far():
    """With a budget below the context, oracle selection (blocks covering >99% of the mass) stays close to dense
    while StreamingLLM-style static selection at the same budget visibly differs."""
    model = _sharp_llama("eager")
    ids = torch.randint(1, VOCAB, (1, 420), generator=torch.Generator().manual_seed(3))
    prompt, bs, budget_blocks = 400, 16, 16  # 16 of 27 blocks
    # Premise, from exact attention: sinks + recent window + the top blocks by GQA-group mass hold > 99% of every
    # head's attention mass at every decode step.
    attn = model(ids, output_attentions=True).attentions
    for probs in attn:  # (1, H_q, T, T)
        rows = torch.nn.functional.pad(probs[0, :, prompt - 1 :], (0, 27 * bs - 420)).view(4, -1, 27, bs).sum(-1)
        group = rows.view(2, 2, -1, 27).sum(1)  # (H_kv, steps, blocks)
        for step in range(rows.shape[1]):
            last = (prompt + step) // bs  # block of the newest token
            forced = {0, last, last - 1, last - 2}
            for kv in range(2):
                picks = forced | set(
                    [b for b in group[kv, step].argsort(descending=True).tolist() if b not in forced][
                        : budget_blocks - len(forced)])
                for head in (2 * kv, 2 * kv + 1):
                    assert rows[head, step, sorted(picks)].sum() > 0.99
    oasis_hf.enable(model)
    dense = _teacher_forced_logits(model, DynamicCache(config=model.config), ids, prompt)
    budget = dict(budget_tokens=budget_blocks * bs, max_fetch_blocks=None)
    oracle = _teacher_forced_logits(model, oasis_cache(model, selector="oracle", **budget), ids, prompt)
    static = _teacher_forced_logits(model, oasis_cache(model, selector="static", **budget), ids, prompt)
    err_oracle = (oracle - dense).abs().max().item()
    err_static = (static - dense).abs().max().item()
    print(f"oracle max|dlogit| {err_oracle:.4g}, static {err_static:.4g}")
    assert err_oracle < 0.2 * err_static, f"oracle err {err_oracle:.3g} vs static err {err_static:.3g}"
    assert err_static > 0.05
    assert torch.equal(oracle.argmax(-1), dense.argmax(-1))


@pytest.mark.parametrize("selector", ["lookahead", "previous-query"])
def test_sync_fetch_corrects_an_asynchronous_selection_inside_the_step(selector):
    """`sync_fetch_blocks`: each step's own queries top up what the background job prefetched. With a cap that
    covers every slot the residents at attention are the step's own top blocks, so the logits are current-query's
    (no selection memory on either); with a small cap the correction fetches at most that many blocks per
    (sequence, KV head, layer) and step, and each larger cap moves the logits closer to current-query's."""
    model = _sharp_llama("oasis")
    ids = torch.randint(1, VOCAB, (1, 420), generator=torch.Generator().manual_seed(3))
    prompt, common = 400, dict(budget_tokens=256, score_decay=0.0, prefetch=False)

    def run(**kw):
        cache = oasis_cache(model, **{**common, **kw})
        logits = _teacher_forced_logits(model, cache, ids, prompt)
        return logits, cache

    current, cache = run(selector="current-query", max_fetch_blocks=None)
    assert cache.stats.summary()["corrected_blocks"] == 0  # a synchronous selector's fetches are its selection
    gaps = []
    for cap in (0, 1, 4):
        logits, cache = run(selector=selector, sync_fetch_blocks=cap)
        gaps.append((logits - current).abs().mean().item())
        for layer in cache.oasis_layers:
            layer.table.check()
        stats = cache.stats.summary()
        # Counted apart from the jobs' fetches (and inside the total): at most `cap` per KV head and layer-step.
        limit = cap * model.config.num_key_value_heads * stats["decode_layer_steps"]
        assert (0 < stats["corrected_blocks"] <= limit) if cap else stats["corrected_blocks"] == 0, (cap, stats)
        assert stats["fetched_blocks"] > stats["corrected_blocks"]
    assert gaps[0] > 1e-2, "premise: the asynchronous selection differs from the step's own"
    assert gaps[0] > gaps[1] > gaps[2], gaps
    corrected, _ = run(selector=selector, sync_fetch_blocks=16)  # 16 slots: the whole budget
    torch.testing.assert_close(corrected, current, atol=1e-5, rtol=1e-5)


def test_sync_fetch_memory_ranks_the_correction_without_updating_the_memory():
    """`sync_fetch_memory`: the in-step correction ranks blocks by the step's share or the decayed selection memory
    and leaves the memory to the background jobs. Layer 0's queries and summaries do not depend on what was resident,
    so its memory after a run is the jobs' alone, with or without a correction that reads it; the correction still
    fetches, and the memory changes what it keeps (the logits differ from the memory-less correction's)."""
    model = _sharp_llama("oasis")
    ids = torch.randint(1, VOCAB, (1, 420), generator=torch.Generator().manual_seed(3))
    common = dict(budget_tokens=256, score_decay=0.9, prefetch=False, selector="lookahead")
    runs = {}
    for name, fields in (("no correction", {}), ("own queries", dict(sync_fetch_blocks=2)),
                         ("with memory", dict(sync_fetch_blocks=2, sync_fetch_memory=True))):
        cache = oasis_cache(model, **common, **fields)
        logits = _teacher_forced_logits(model, cache, ids, 400)
        for layer in cache.oasis_layers:
            layer.table.check()
        runs[name] = (logits, cache.oasis_layers[0].score_memory.clone(), cache.stats.summary())
    assert torch.equal(runs["with memory"][1], runs["no correction"][1])
    assert runs["with memory"][2]["corrected_blocks"] > 0
    assert (runs["with memory"][0] - runs["own queries"][0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="score_decay > 0"):
        oasis_hf.OasisConfig(selector="lookahead", sync_fetch_blocks=2, sync_fetch_memory=True, score_decay=0.0)


def test_beam_search_is_refused():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([60])
    with pytest.raises(UnsupportedError, match="beam search"):
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=oasis_cache(model), num_beams=2,
                       max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_unsupported_layer_type_is_refused():
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedError, match="linear_attention"):
        OasisCache(model.config)


def test_impossible_host_allocation_fails_before_work():
    model = tiny_model("llama", attn="oasis")
    cache = oasis_cache(model, host_capacity_tokens=10**12)
    ids, mask = left_padded([40])
    with pytest.raises(HostMemoryError, match=r"needs .* GiB more host memory .* bytes\) but only") as err:
        generate(model, ids, mask, cache)
    assert err.value.needed > err.value.available
    assert cache.host.capacity_blocks == 0  # nothing was allocated


def test_host_memory_limit_caps_the_store_and_names_the_setting():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100])
    cache = oasis_cache(model, host_growth_tokens=32, host_memory_limit_bytes=1 << 20)
    generate(model, ids, mask, cache)  # 2 layers x 128 tokens x 2 KV heads x head_dim x fp32 fits in 1 MiB
    held = cache.host_nbytes()
    assert 0 < held <= 1 << 20
    small = oasis_cache(model, host_memory_limit_bytes=held // 2)
    with pytest.raises(HostMemoryError, match="host_memory_limit_bytes") as err:
        generate(model, ids, mask, small)
    assert err.value.available == held // 2
    assert small.host.capacity_blocks == 0


def test_model_without_oasis_attention_is_caught():
    model = tiny_model("llama", attn="sdpa")
    ids, mask = left_padded([40])
    with pytest.raises(UnsupportedError, match="set_attn_implementation"):
        generate(model, ids, mask, oasis_cache(model))


def test_crop_both_conventions_and_reset():
    model = tiny_model("llama", attn="oasis")
    ids = torch.randint(1, VOCAB, (1, 70))
    cache = oasis_cache(model, budget_tokens=128)
    model(ids[:, :60], past_key_values=cache)
    model(ids[:, 60:70], past_key_values=cache)
    cache.crop(-4)  # 5.18+ convention
    assert cache.get_seq_length() == 66
    cache.crop(64)  # 5.17 legacy: absolute length
    assert cache.get_seq_length() == 64
    cache.crop(0)
    assert cache.get_seq_length() == 64
    for layer in cache.oasis_layers:
        layer.table.check()
        assert int(layer.table.slot_block[..., :8].max()) < 4  # blocks past the end were freed
    # decoding continues from the cropped state exactly as from a fresh cache fed the same 64 tokens
    fresh = oasis_cache(model, budget_tokens=128)
    model(ids[:, :60], past_key_values=fresh)
    model(ids[:, 60:64], past_key_values=fresh)
    a = model(ids[:, 64:65], past_key_values=cache).logits
    b = model(ids[:, 64:65], past_key_values=fresh).logits
    torch.testing.assert_close(a, b)
    host = cache.host
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.host is host  # kept for the next batch (close frees it)


def test_registration_is_explicit():
    import subprocess
    import sys

    code = ("import oasis_hf; from transformers import AttentionInterface; "
            "assert 'oasis' not in AttentionInterface._global_mapping; oasis_hf.register(); "
            "assert 'oasis' in AttentionInterface._global_mapping")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("selector", "summary"), [("current-query", "minmax"), ("lookahead", "mean+minmax"),
                                                  ("lookahead", "quantized")])
def test_triton_backend_inside_generate(selector, summary):
    """The fused decode step (append_tokens, score_blocks, plan_blocks, gather_blocks, sparse attention with its
    merge) on the Triton kernels gives the twins' tokens and fetches under real selection (8 slots), and dense
    attention's tokens when the budget covers the context."""
    from oasis_hf.kernels import INTERPRET, TRITON_AVAILABLE

    if not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (set by .ci/run)")
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    model = tiny_model("qwen2", attn="oasis", device=dev)
    ids, mask = left_padded([90, 70])
    # 6 slots for 8 blocks (114 tokens): evictions and fetches. Jobs inline: Triton's interpreter cannot run kernels
    # from two threads (the cache refuses it, tested below).
    small = dict(budget_tokens=96, max_fetch_blocks=2, selector=selector, summary=summary, prefetch=False)
    fetched = []
    outs = []
    for backend in ("torch", "triton"):
        with oasis_cache(model, kernel_backend=backend, **small) as cache:
            outs.append(generate(model, ids.to(dev), mask.to(dev), cache))
            fetched.append(cache.stats.summary()["fetched_blocks"])
    assert torch.equal(outs[1], outs[0])
    assert fetched[1] == fetched[0] > 0
    if selector == "current-query":  # a budget covering the context: the fused step gives dense attention's tokens
        dense = tiny_model("qwen2", device=dev)
        ref = generate(dense, ids.to(dev), mask.to(dev), DynamicCache(config=dense.config))
        with oasis_cache(model, kernel_backend="triton", summary=summary, prefetch=False, budget_tokens=128) as cache:
            assert torch.equal(generate(model, ids.to(dev), mask.to(dev), cache), ref)
    if INTERPRET and selector == "lookahead":
        with oasis_cache(model, kernel_backend="triton", **dict(small, prefetch=True)) as cache:
            with pytest.raises(UnsupportedError, match="prefetch=False"):
                generate(model, ids, mask, cache)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_fills_every_slot_from_the_prompt(backend):
    """After a left-padded prefill over more blocks than the budget, every slot holds its block's K/V rows as the
    host store has them (zero past the last token), the summaries equal those written afresh from the host keys,
    and the statistics count one initial block per slot."""
    from oasis_hf.cache.summaries import BlockSummaries
    from oasis_hf.kernels import INTERPRET, TRITON_AVAILABLE

    if backend == "triton" and not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (set by .ci/run)")
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    model = tiny_model("llama", attn="oasis", device=dev)
    ids, mask = left_padded([181, 140])
    with oasis_cache(model, kernel_backend=backend, budget_tokens=96, prefetch=False) as cache, torch.inference_mode():
        model(ids.to(dev), attention_mask=mask.to(dev), past_key_values=cache, use_cache=True)
        slots = 0
        for layer in cache.oasis_layers:
            n, bs = layer.length, 16
            keys, values = (x.cpu() for x in cache.host.read_range(layer.layer_idx, n, "cpu"))
            padded_k, padded_v = (torch.nn.functional.pad(x, (0, 0, 0, bs)) for x in (keys, values))
            resident = layer.table.slot_block[..., : layer.budget_blocks].cpu()
            pool_k, pool_v = layer.pool_k.cpu(), layer.pool_v.cpu()
            for b, h, slot in (resident >= 0).nonzero().tolist():
                blk = int(resident[b, h, slot])
                assert torch.equal(pool_k[b, h, slot], padded_k[b, h, blk * bs : blk * bs + bs])
                assert torch.equal(pool_v[b, h, slot], padded_v[b, h, blk * bs : blk * bs + bs])
            slots += int((resident >= 0).sum())
            assert bool((resident >= 0).all())  # 12 blocks per sequence, 6 slots: every slot is filled
            fresh = BlockSummaries("mean", 2, layer.num_kv_heads, -(-n // bs), layer.head_dim, keys.dtype, "cpu", bs)
            fresh.write(keys, layer.kv_start.cpu(), 0, "torch")
            torch.testing.assert_close(layer.summaries.data[:, :, :, : -(-n // bs)].cpu(), fresh.data,
                                       atol=1e-6, rtol=1e-6)
        assert cache.stats.summary()["initial_blocks"] == slots == len(cache.oasis_layers) * 2 * 2 * 6


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("selector", ["current-query", "lookahead"])
@pytest.mark.parametrize("why", [dict(budget_tokens=128, dense_chunk_tokens=64), dict(budget_tokens=96)],
                         ids=["longer-than-dense_chunk_tokens", "more-blocks-than-the-budget"])
def test_chunked_prefill_equals_one_prefill(family, selector, why):
    """A prompt fed in chunks of 120, 100 and 80 tokens (attended exactly over K/V read back from host) gives the
    logits of a single prefill, and the same greedy continuation under a small budget. The later chunks take the
    exact path because they are longer than dense_chunk_tokens (64), or because their blocks (7 and 6, plus a sink)
    do not fit a 6-slot budget."""
    model = tiny_model(family, attn="oasis")
    ids = torch.randint(1, VOCAB, (2, 300), generator=torch.Generator().manual_seed(11))
    fields = dict(max_fetch_blocks=2, selector=selector, **why)
    one, one_tokens, _ = _prompt_in_chunks(model, ids, [300], 12, **fields)
    chunked, chunked_tokens, fetched = _prompt_in_chunks(model, ids, [120, 100, 80], 12, **fields)
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=1e-4)
    assert torch.equal(chunked_tokens, one_tokens)
    assert fetched > 0


def _prompt_in_chunks(model, ids, chunks, new_tokens, **fields):
    """Feed `ids` to a new OasisCache(`fields`) in forwards of `chunks` tokens, then decode `new_tokens` greedily:
    (the prompt's logits, the tokens, the blocks fetched)."""
    with oasis_cache(model, **fields) as cache, torch.inference_mode():
        logits, at = [], 0
        for size in chunks:
            logits.append(model(ids[:, at : at + size], past_key_values=cache, use_cache=True).logits)
            at += size
        token, tokens = logits[-1][:, -1:].argmax(-1), []
        for _ in range(new_tokens):
            tokens.append(token)
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return torch.cat(logits, dim=1), torch.cat(tokens, dim=1), cache.stats.summary()["fetched_blocks"]


def test_chunked_prefill_on_the_triton_kernels_equals_the_twins():
    """A prompt in chunks of 120, 100 and 80 tokens on the Triton kernels (each chunk's first selection from the
    exact mass of its last queries, `block_mass`; then the fused decode step) gives the twins' logits and tokens."""
    from oasis_hf.kernels import INTERPRET, TRITON_AVAILABLE

    if not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (set by .ci/run)")
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    model = tiny_model("llama", attn="oasis", device=dev)
    ids = torch.randint(1, VOCAB, (2, 300), generator=torch.Generator().manual_seed(11)).to(dev)
    # Jobs inline: Triton's interpreter cannot run kernels from two threads.
    fields = dict(selector="lookahead", budget_tokens=96, max_fetch_blocks=2, prefill_window_tokens=16, prefetch=False)
    twin_logits, twin_tokens, twin_fetched = _prompt_in_chunks(model, ids, [120, 100, 80], 6, kernel_backend="torch",
                                                               **fields)
    logits, tokens, fetched = _prompt_in_chunks(model, ids, [120, 100, 80], 6, kernel_backend="triton", **fields)
    torch.testing.assert_close(logits, twin_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, twin_tokens) and fetched == twin_fetched > 0


def test_generate_with_hf_prefill_chunking_equals_one_prefill():
    """transformers' own chunked prefill (`prefill_chunk_size`) runs on OasisCache and gives the same tokens."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300, 260])
    one = generate(model, ids, mask, oasis_cache(model, budget_tokens=128, max_fetch_blocks=2))
    chunked = generate(model, ids, mask, oasis_cache(model, budget_tokens=128, max_fetch_blocks=2),
                       prefill_chunk_size=100)
    assert torch.equal(chunked, one)


def test_attention_takes_dropout_by_position_like_transformers():
    """Wrappers that call attention functions positionally (kvpress patches every registered one this way when it is
    imported) pass ``dropout`` sixth, as in transformers' own signature: with OasisCache layers behind them,
    generation still equals dense."""
    import inspect

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    ours = list(inspect.signature(oasis_hf.oasis_attention).parameters)[:7]
    assert ours == list(inspect.signature(sdpa_attention_forward).parameters)[:7]

    def positional(module, query, key, value, attention_mask, dropout, **kwargs):  # kvpress's wrapper shape
        return oasis_hf.oasis_attention(module, query, key, value, attention_mask, dropout, **kwargs)

    AttentionInterface.register("oasis_positional", positional)
    AttentionMaskInterface.register("oasis_positional", oasis_hf.compat.flash_attention_mask)
    ids, mask = left_padded([60, 45])
    ref = generate(tiny_model("llama"), ids, mask, DynamicCache(config=tiny_model("llama").config))
    model = tiny_model("llama")
    model.set_attn_implementation("oasis_positional")
    assert torch.equal(generate(model, ids, mask, oasis_cache(model)), ref)


def test_a_limit_that_holds_the_prompt_but_not_the_answer_is_refused_before_decoding():
    """host_memory_limit_bytes that fits the prompt but not prompt + max_new_tokens: generate refuses at the first
    layer of the prefill (nothing stored), naming the longest length that fits. Before, decoding failed several steps
    in, when the store grew by half its size at a time. A limit that holds exactly the planned length decodes."""
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([100])
    # 2 layers x (K, V) x 2 KV heads x head dim 16 x fp32 = 512 bytes per token; blocks of 16 tokens: 8 KiB each.
    limit = 8 * 16 * 512  # 8 blocks: 128 tokens
    cache = oasis_cache(model, host_memory_limit_bytes=limit)
    with pytest.raises(HostMemoryError, match=r"64.00 KiB.*at most 128 tokens") as err:
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64,
                       do_sample=False, pad_token_id=0)
    assert err.value.fits_tokens == 128
    assert cache.get_seq_length() == 0 and cache.host.capacity_blocks == 0
    ok = oasis_cache(model, host_memory_limit_bytes=limit)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=ok, max_new_tokens=28,
                         min_new_tokens=28, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 128 and ok.host.capacity_blocks == 8


def test_growth_takes_what_fits_when_half_again_does_not():
    """The store prefers to grow by half its size (or host_growth_tokens) at once; under a limit that cannot hold
    that it takes only the blocks required, and refuses (with what fits) only when those do not fit."""
    from oasis_hf.cache.host_store import HostKVStore

    store = HostKVStore([0, 1], 1, 2, 16, 16, torch.float32, pin=False, headroom_bytes=0, growth_tokens=4096,
                        limit_bytes=8 * 16 * 512)
    store.ensure_capacity(100)
    assert store.capacity_blocks == 7
    store.ensure_capacity(113)  # one more block: half again (or 256 blocks) does not fit, one does
    assert store.capacity_blocks == 8
    with pytest.raises(HostMemoryError, match="at most 128 tokens"):
        store.ensure_capacity(129)
    from oasis_hf.errors import format_bytes

    assert [format_bytes(n) for n in (512, 3.5 * 2**20, 1.5 * 2**30)] == ["512 bytes", "3.50 MiB", "1.50 GiB"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [False, True])
def test_enabled_model_still_decodes_other_caches_like_sdpa(family, padded):
    """A model switched to the oasis attention decodes a preallocated StaticCache (keys past the last query are
    unwritten slots) and a DynamicCache exactly as on SDPA: rows that do not use OasisCache are unaffected."""
    torch.manual_seed(0)
    model = tiny_model(family)
    ids = torch.randint(3, VOCAB, (2, 40))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :7] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=9, min_new_tokens=9, do_sample=False,
                  pad_token_id=0)
    before = {impl: model.generate(**kwargs, cache_implementation=impl) for impl in ("static", "dynamic")}
    oasis_hf.enable(model)
    for impl, tokens in before.items():
        assert torch.equal(model.generate(**kwargs, cache_implementation=impl), tokens), impl
    # An explicit StaticCache decoded without any mask (kvpress-style loops): causal over the written slots only.
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=64)
    logits = model(input_ids=ids[1:], past_key_values=cache, use_cache=True).logits
    step = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
    model.set_attn_implementation("sdpa")
    ref_cache = DynamicCache()
    ref = model(input_ids=ids[1:], past_key_values=ref_cache, use_cache=True).logits
    ref_step = model(input_ids=ref[:, -1:].argmax(-1), past_key_values=ref_cache, use_cache=True).logits
    torch.testing.assert_close(step, ref_step)
