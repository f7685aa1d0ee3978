"""The prefill observation window (`prefill_window_tokens`) and the selection memory (`score_decay`)."""

import pytest
import torch
from transformers import DynamicCache

import oasis_hf.cache.prefill as prefill_module
from oasis_hf.cache import scoring
from oasis_hf.cache.scoring import block_mass
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded

SMALL = dict(budget_tokens=128, max_fetch_blocks=2)  # 8 slots of 16: 1 sink, 3 recent, 4 selected


def test_block_mass_is_each_rows_causal_softmax_summed_per_block():
    gen = torch.Generator().manual_seed(0)
    batch, h_q, h_kv, t, n, d, bs = 2, 4, 2, 3, 70, 8, 16
    q = torch.randn(batch, h_q, t, d, generator=gen)
    k = torch.randn(batch, h_kv, n, d, generator=gen)
    kv_start = torch.tensor([0, 5])
    q_pos = torch.tensor([60, 61, 62])
    got = block_mass(q, k, 0.3, q_pos, kv_start, bs, capacity_blocks=6)
    want = torch.zeros(batch, h_kv, 6)
    for b in range(batch):
        for h in range(h_q):
            kv = h // (h_q // h_kv)
            for i in range(t):
                keys = torch.arange(int(kv_start[b]), int(q_pos[i]) + 1)
                p = torch.softmax(q[b, h, i] @ k[b, kv, keys].T * 0.3, dim=0)
                want[b, kv].index_add_(0, keys // bs, p)
    torch.testing.assert_close(got, want)
    assert got[..., 5].abs().max() == 0  # past the last block (70 tokens: 5 blocks)


def spy_block_mass(monkeypatch) -> list:
    calls = []
    original = prefill_module.block_mass

    def spy(query, keys, scale, q_pos, kv_start, block_size, capacity, backend="auto"):
        out = original(query, keys, scale, q_pos, kv_start, block_size, capacity, backend)
        calls.append((query.shape[2], q_pos.clone(), keys.shape[2], out))
        return out

    monkeypatch.setattr(prefill_module, "block_mass", spy)
    return calls


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefill_window_selects_the_top_blocks_of_the_last_queries_exact_attention(monkeypatch, family):
    model = tiny_model(family, attn="oasis")
    ids, mask = left_padded([300, 260])
    calls = spy_block_mass(monkeypatch)
    monkeypatch.setattr(prefill_module, "MASS_CHUNK_BYTES", 1)  # one (sequence, KV head) per call
    with oasis_cache(model, selector="lookahead", prefill_window_tokens=8, **SMALL) as cache:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        layers = cache.oasis_layers
        heads = layers[0].num_kv_heads
        per_layer = 2 * heads
        assert len(calls) == per_layer * len(layers)  # one call per sequence, KV head and full-attention layer
        for li, layer in enumerate(layers):
            mine = calls[per_layer * li : per_layer * (li + 1)]
            mass = torch.stack([torch.stack([mine[b * heads + h][3][0, 0] for h in range(heads)]) for b in range(2)])
            for window, q_pos, num_keys, _ in mine:
                assert window == 8 and num_keys == 300 and q_pos.tolist() == list(range(292, 300))
            resident = layer.table.slot_block[..., : cache.config.budget_blocks]
            for b in range(2):
                first = int(layer.kv_start[b]) // 16
                forced = {first, 16, 17, 18}  # the sink, the recent window (2 blocks + the last)
                candidates = [i for i in range(first, 19) if i not in forced]
                for h in range(layer.num_kv_heads):
                    chosen = {int(x) for x in resident[b, h] if x >= 0} - forced
                    order = sorted(candidates, key=lambda i: (-float(mass[b, h, i]), i))
                    assert chosen == set(order[: len(chosen)]) and len(chosen) == 4


@pytest.mark.parametrize("pairs", [1, 3, 4, 6])
def test_prefill_window_in_chunks_of_pairs_selects_as_one_call(monkeypatch, pairs):
    """The window's exact attention mass is computed for as many (sequence, KV head) pairs per call as
    MASS_CHUNK_BYTES holds: any chunking (one pair, part of a sequence's heads, several sequences, uneven last
    chunk) selects the blocks that the whole batch in one call selects."""
    model = tiny_model("llama", attn="oasis")  # 2 KV heads, GQA 2, head dim 16
    ids, mask = left_padded([300, 260, 280])
    window, end = 8, ids.shape[1]
    tables, calls = [], spy_block_mass(monkeypatch)
    for chunk in (None, pairs):
        if chunk is not None:  # bytes of `chunk` pairs' temporaries (prefill_scores' estimate)
            monkeypatch.setattr(prefill_module, "MASS_CHUNK_BYTES", chunk * 4 * end * (4 * 2 * window + 16))
        calls.clear()
        with oasis_cache(model, selector="lookahead", prefill_window_tokens=window, **SMALL) as cache:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            tables.append([layer.table.slot_block.clone() for layer in cache.oasis_layers])
            layers = len(cache.oasis_layers)
        expected = {1: 6, 3: 3, 4: 2, 6: 1}[chunk] if chunk is not None else 1
        assert len(calls) == expected * layers
    for one_call, chunked in zip(*tables, strict=True):
        assert torch.equal(one_call, chunked)


def test_prefill_window_zero_keeps_the_last_query_against_the_summaries(monkeypatch):
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300])
    calls = spy_block_mass(monkeypatch)
    with oasis_cache(model, selector="lookahead", prefill_window_tokens=0, **SMALL) as cache:
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert calls == []
    with oasis_cache(model, selector="static", **SMALL) as cache:  # static takes no window (default 32)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert calls == []


def test_prefill_window_on_chunked_prefill_uses_each_chunks_last_queries(monkeypatch):
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300])
    calls = spy_block_mass(monkeypatch)
    with oasis_cache(model, selector="current-query", prefill_window_tokens=8, **SMALL) as cache:
        model(input_ids=ids[:, :200], attention_mask=mask[:, :200], past_key_values=cache)
        model(input_ids=ids[:, 200:], attention_mask=mask, past_key_values=cache)  # 100 tokens > dense_chunk_tokens
        for layer in cache.oasis_layers:
            layer.table.check()
    layers = 2  # one call per layer: the batch's (sequence, KV head) pairs fit in one
    assert [(w, q.tolist()[0], n) for w, q, n, _ in calls] == [(8, 192, 200)] * layers + [(8, 292, 300)] * layers


@pytest.mark.parametrize("fields", [dict(prefill_window_tokens=16), dict(score_decay=0.8),
                                    dict(prefill_window_tokens=16, score_decay=0.8)])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_options_keep_attention_exact_when_the_budget_covers_the_context(family, fields):
    ids, mask = left_padded([150, 97])
    dense = tiny_model(family)
    ref = generate(dense, ids, mask, DynamicCache(config=dense.config))
    model = tiny_model(family, attn="oasis")
    with oasis_cache(model, selector="lookahead", **fields) as cache:
        assert torch.equal(generate(model, ids, mask, cache), ref)


def test_score_decay_keeps_the_larger_of_the_new_share_and_the_decayed_memory():
    model = tiny_model("llama", attn="oasis")  # 4 query heads, 2 KV heads: G = 2
    ids, mask = left_padded([300, 260])
    with oasis_cache(model, selector="current-query", score_decay=0.5, **SMALL) as cache, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        layer = cache.oasis_layers[0]
        nb = layer.table.capacity_blocks
        query = torch.zeros(2, 4, 3, layer.head_dim)  # G * T = 6 rows per KV head
        last = torch.tensor(299)
        first = torch.zeros(2, 2, nb)
        first[..., 5] = 6.0
        first[..., 0] = 6.0  # sequence 1 starts at token 40: its block 0 is padding
        layer.score_memory.zero_()
        scoring.block_scores(layer, query, 1.0, last, num_tokens=1, raw=first)
        assert float(layer.score_memory[0, 0, 5]) == pytest.approx(1.0)  # 6 / 6 rows
        second = torch.zeros(2, 2, nb)
        second[..., 7] = 1.2
        scores = scoring.block_scores(layer, query, 1.0, last, num_tokens=1, raw=second)
        assert float(layer.score_memory[0, 0, 5]) == pytest.approx(0.5)  # remembered, halved
        assert float(layer.score_memory[0, 0, 7]) == pytest.approx(0.2)  # new share 1.2 / 6
        assert float(scores[0, 0, 5]) > float(scores[0, 0, 7])  # the remembered block still ranks first
        assert float(layer.score_memory[0, 0, 0]) > 0 and float(layer.score_memory[1, :, 0].abs().max()) == 0


def test_score_decay_changes_the_selection_under_a_small_budget_and_resets():
    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([300, 260])
    fetched = {}
    for decay in (0.0, 0.95):  # (the default is 0.9)
        with oasis_cache(model, selector="lookahead", score_decay=decay, **SMALL) as cache:
            generate(model, ids, mask, cache)
            fetched[decay] = cache.stats.summary()["fetched_blocks"]
            for layer in cache.oasis_layers:
                layer.table.check()
            remembered = float(cache.oasis_layers[0].score_memory.abs().sum())
            assert (remembered > 0) == (decay > 0)
            cache.reset()
            assert float(cache.oasis_layers[0].score_memory.abs().sum()) == 0
    assert fetched[0.95] < fetched[0.0]  # memory holds blocks longer: fewer swaps


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("summary", ["minmax", "mean+minmax", "quantized"])
def test_summaries_after_decoding_describe_the_host_keys(family, summary):
    """Below the context (8 slots of 16 for 180+ tokens), decoding with lookahead rewrites the summaries of the
    blocks each step touches; afterwards every layer's summaries (Quest's lo/hi, and the mean key for
    ``mean+minmax``; the bounds and every key code for ``quantized``) equal those written afresh from the keys in
    the host store, partial last block included."""
    from oasis_hf.cache.summaries import BlockSummaries

    model = tiny_model(family, attn="oasis")
    ids, mask = left_padded([181])
    with oasis_cache(model, selector="lookahead", summary=summary, **SMALL) as cache:
        out = generate(model, ids, mask, cache)
        assert out.shape[1] == 181 + 24
        for layer in cache.oasis_layers:
            n = layer.length
            nb = -(-n // 16)
            keys = cache.host.read_keys(layer.layer_idx, n)  # (1, H_kv, n, D)
            fresh = BlockSummaries(summary, 1, layer.num_kv_heads, nb, layer.head_dim, keys.dtype, "cpu", 16)
            fresh.write(keys, torch.zeros(1, dtype=torch.long), 0, "torch")
            assert layer.summaries.data.shape[0] == fresh.data.shape[0]
            torch.testing.assert_close(layer.summaries.data[:, :, :, :nb], fresh.data, atol=1e-5, rtol=1e-5)
            if summary == "quantized":
                assert torch.equal(layer.summaries.codes[:, :, :nb], fresh.codes)


@pytest.mark.parametrize("summary", ["mean", "quantized"])
def test_a_custom_selector_reads_the_summary_kind_and_its_codes(summary):
    """A selector with ``scoring = "custom"`` gets the layer's summaries with their kind, and for ``quantized`` the
    key codes, which dequantize into keys within one quantization step of the keys in the host store."""
    from oasis_hf.kernels.ref import dequantize_blocks
    from oasis_hf.selectors.oracle import OracleSelector

    seen = []

    class Recording(OracleSelector):  # the oracle's exact scores, so decoding goes on as with the oracle
        def score(self, context, query, scale):
            seen.append(context)
            return super().score(context, query, scale)

    model = tiny_model("llama", attn="oasis")
    ids, mask = left_padded([150])
    with oasis_cache(model, selector="oracle", summary=summary, **SMALL) as cache:
        cache.selector = Recording()
        generate(model, ids, mask, cache)
        assert seen, "the custom selector was never asked to score"
        context, layer = seen[-1], cache.oasis_layers[-1]
        assert context.kind == summary and context.summaries is layer.summaries.data
        if summary == "mean":
            assert context.codes is None
            return
        assert context.codes is layer.summaries.codes
        n = layer.length
        nb = n // 16  # whole blocks only
        keys = cache.host.read_keys(layer.layer_idx, nb * 16).float().unflatten(2, (nb, 16))
        bounds = context.summaries[:, :, :, :nb].float()
        back = dequantize_blocks(context.codes[:, :, :nb], bounds)
        step = (bounds[1] - bounds[0])[..., None, :] / 3
        assert bool(((back - keys).abs() <= step / 2 + 1e-4).all())
