"""`greedy_continue`: greedy decoding that continues a prefilled cache over a StaticCache copy (the kvpress rows'
decode loop; CUDA graphs on CUDA, the same loop eagerly here)."""

import pytest
import torch
from transformers import DynamicCache

from eval.static_decode import greedy_continue
from oasis_hf import compat
from oasis_hf.errors import UnsupportedError
from tests._factories import tiny_model


def _prefill(model, ids):
    cache = DynamicCache()
    out = model(input_ids=ids, use_cache=True, **{compat.cache_kwarg(model): cache})
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_continue_equals_generate(family):
    torch.manual_seed(0)
    model = tiny_model(family)
    ids = torch.randint(3, model.config.vocab_size, (1, 150))
    reference = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                               pad_token_id=0)[:, ids.shape[1]:]
    cache, first = _prefill(model, ids)
    kept = [layer.keys.clone() for layer in cache.layers]
    new = greedy_continue(model, cache, first, position=ids.shape[1], max_new_tokens=11)
    assert torch.equal(new, reference)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(kept, cache.layers, strict=True))  # cache untouched


def test_greedy_continue_positions_follow_the_uncompressed_prompt():
    """After dropping prompt tokens from the cache (what a press does), rotary positions continue from the original
    prompt length while the cache slots continue from the tokens kept: the tokens of an eager loop doing that."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 120))
    cache, first = _prefill(model, ids)
    for layer in cache.layers:  # keep every other token, as a press might
        layer.keys, layer.values = layer.keys[:, :, ::2].contiguous(), layer.values[:, :, ::2].contiguous()
    kept = cache.layers[0].keys.shape[2]
    right = greedy_continue(model, cache, first, position=ids.shape[1], max_new_tokens=8)
    # Reference: eager decoding with explicit positions over the compressed DynamicCache itself.
    tokens, nxt = [first], first
    for step in range(8):
        out = model(input_ids=nxt, position_ids=torch.tensor([[ids.shape[1] + step]]), use_cache=True,
                    **{compat.cache_kwarg(model): cache})
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
    assert torch.equal(right, torch.cat(tokens, dim=1)) and kept == 60


def test_greedy_continue_stops_at_eos_and_refuses_batches():
    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 64))
    cache, first = _prefill(model, ids)
    full = greedy_continue(model, cache, first, position=64, max_new_tokens=10)
    stop = int(full[0, 3])
    cut = greedy_continue(model, cache, first, position=64, max_new_tokens=10, eos_token_id=[stop])
    first_stop = int((full[0] == stop).nonzero()[0])
    assert torch.equal(cut, full[:, : first_stop + 1])
    with pytest.raises(UnsupportedError, match="one position per row"):
        greedy_continue(model, cache, torch.cat([first, first]), position=64, max_new_tokens=3)
    with pytest.raises(UnsupportedError, match="batch"):
        greedy_continue(model, cache, torch.cat([first, first]), position=[64, 64], max_new_tokens=3)


def test_greedy_continue_decodes_a_batch_of_compressed_caches_as_each_alone():
    """Caches of different prompts that kept the same number of tokens, stacked (`stack_caches`), decode together:
    each row's tokens, at its own rotary position, are those it gets alone; a row that stopped is padded while the
    others go on, and decoding ends when every row has stopped."""
    from eval.static_decode import stack_caches

    torch.manual_seed(0)
    model = tiny_model("qwen2")
    rows = []
    for length in (90, 130, 70):
        ids = torch.randint(3, model.config.vocab_size, (1, length))
        cache, first = _prefill(model, ids)
        for layer in cache.layers:  # every prompt compressed to its last 40 tokens, as a press leaves it
            layer.keys, layer.values = layer.keys[:, :, -40:].contiguous(), layer.values[:, :, -40:].contiguous()
        rows.append((cache, first, length))
    alone = [greedy_continue(model, c, f, position=n, max_new_tokens=9) for c, f, n in rows]
    stacked = stack_caches([c for c, _, _ in rows])
    first = torch.cat([f for _, f, _ in rows])
    together = greedy_continue(model, stacked, first, position=[n for _, _, n in rows], max_new_tokens=9)
    assert torch.equal(together, torch.cat(alone))
    stop = int(alone[1][0, 2])  # the second row stops at its third token; the others stop there only if they meet it
    cut = greedy_continue(model, stacked, first, position=[n for _, _, n in rows], max_new_tokens=9,
                          eos_token_id=stop, pad_token_id=0)
    for row, tokens in enumerate(alone):
        hits = (tokens[0] == stop).nonzero()
        end = int(hits[0]) + 1 if len(hits) else tokens.shape[1]
        assert torch.equal(cut[row, :end], tokens[0, :end]) and bool((cut[row, end:] == 0).all())
    assert cut.shape[1] == max(int((t[0] == stop).nonzero()[0]) + 1 if (t[0] == stop).any() else t.shape[1]
                               for t in alone)
    with pytest.raises(UnsupportedError, match="one length"):
        stack_caches([rows[0][0], _prefill(model, torch.randint(3, 50, (1, 20)))[0]])


@pytest.mark.gpu
@pytest.mark.parametrize("enabled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_continue_cuda_graphs_equal_eager_and_generate(dtype, enabled):
    """On CUDA the steps from the second on are replays of one captured forward: the same tokens as the eager loop
    over the same cache (the same kernels), and in float32 as ``generate``; also on a model switched to the oasis
    attention (its mask for the StaticCache is built on the device inside the capture)."""
    import oasis_hf

    torch.manual_seed(0)
    model = tiny_model("qwen2", device="cuda", dtype=dtype)
    if enabled:
        oasis_hf.enable(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 300), device="cuda")
    cache, first = _prefill(model, ids)
    graphed = greedy_continue(model, cache, first, position=300, max_new_tokens=20)
    eager = greedy_continue(model, cache, first, position=300, max_new_tokens=20, graphs=False)
    assert torch.equal(graphed, eager)
    if dtype == torch.float32:
        reference = model.generate(ids, max_new_tokens=21, min_new_tokens=21, do_sample=False, pad_token_id=0)
        assert torch.equal(graphed, reference[:, 300:])


@pytest.mark.gpu
def test_greedy_continue_cuda_graphs_decode_a_batch_as_eager():
    """A stacked batch of compressed caches (different prompt lengths) decoded with CUDA graphs: the tokens of the
    eager loop over the same batch, and in float32 those of each row alone."""
    from eval.static_decode import stack_caches

    torch.manual_seed(0)
    model = tiny_model("qwen2", device="cuda", dtype=torch.float32)
    rows = []
    for length in (300, 340, 260):
        ids = torch.randint(3, model.config.vocab_size, (1, length), device="cuda")
        cache, first = _prefill(model, ids)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, -128:].contiguous(), layer.values[:, :, -128:].contiguous()
        rows.append((cache, first, length))
    stacked, first = stack_caches([c for c, _, _ in rows]), torch.cat([f for _, f, _ in rows])
    positions = [n for _, _, n in rows]
    graphed = greedy_continue(model, stacked, first, position=positions, max_new_tokens=20)
    assert torch.equal(graphed, greedy_continue(model, stacked, first, position=positions, max_new_tokens=20,
                                                graphs=False))
    alone = [greedy_continue(model, c, f, position=n, max_new_tokens=20) for c, f, n in rows]
    assert torch.equal(graphed, torch.cat(alone))


def test_greedy_continue_gives_the_same_tokens_after_an_oasis_row_on_the_same_model():
    """A press row after an OasisKV row on one model object (what `eval.accuracy` does): `oasis_hf.enable` switched
    the model to the "oasis" attention, whose mask function gives a StaticCache transformers' 4-D mask (its
    unwritten slots masked): the tokens are a fresh model's, and the model is left on "oasis"."""
    import oasis_hf

    torch.manual_seed(0)
    model = tiny_model("qwen2")
    ids = torch.randint(3, model.config.vocab_size, (1, 120))

    def row():
        cache, first = _prefill(model, ids)
        for layer in cache.layers:  # a compressed prompt, as a press leaves it
            layer.keys, layer.values = layer.keys[:, :, ::2].contiguous(), layer.values[:, :, ::2].contiguous()
        return greedy_continue(model, cache, first, position=ids.shape[1], max_new_tokens=10)

    fresh = row()
    oasis_hf.enable(model)
    assert torch.equal(row(), fresh)
    assert compat.text_config(model.config)._attn_implementation == oasis_hf.ATTENTION_NAME
