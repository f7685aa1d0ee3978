"""`dense_attention`, the prefill path and the fallback of the oasis attention: checked against a float64 softmax
written out position by position, for every mask shape it takes."""

import pytest
import torch

from oasis_hf.kernels import dense
from oasis_hf.kernels.dense import dense_attention


def reference(query, key, value, padding_mask, scale, sliding_window=None):
    """(B, T, H_q, D): query t at key position L - T + t sees the real keys at or before it (and inside the window),
    and always its own position."""
    batch, heads, tokens, _ = query.shape
    group = heads // key.shape[1]
    length = key.shape[2]
    out = torch.zeros(batch, tokens, heads, value.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for t in range(tokens):
            pos = length - tokens + t
            seen = [k for k in range(length) if k <= pos and (padding_mask is None or padding_mask[b, k])
                    and (sliding_window is None or pos - k < sliding_window)]
            seen = sorted(set(seen) | {pos})
            for h in range(heads):
                q = query[b, h, t].double()
                k = key[b, h // group, seen].double()
                v = value[b, h // group, seen].double()
                out[b, t, h] = torch.softmax(k @ q * scale, dim=0) @ v
    return out


def inputs(batch=3, q_heads=4, kv_heads=2, tokens=24, length=24, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, q_heads, tokens, dim, generator=gen),
            torch.randn(batch, kv_heads, length, dim, generator=gen),
            torch.randn(batch, kv_heads, length, dim, generator=gen))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_left_padded_prefill_runs_unpadded_per_sequence_and_matches(kv_heads, monkeypatch):
    """Left padding of 0, 5 and all 24 tokens (a row with no real token: every query sees only its own position)."""
    query, key, value = inputs(kv_heads=kv_heads)
    mask = torch.ones(3, 24, dtype=torch.long)
    mask[1, :5] = 0
    mask[2] = 0
    calls = []
    real = dense._left_padded_prefill
    monkeypatch.setattr(dense, "_left_padded_prefill", lambda *a: calls.append(1) or real(*a))
    out = dense_attention(query, key, value, mask, scale=0.3)
    assert calls == [1]
    torch.testing.assert_close(out, reference(query, key, value, mask.bool(), 0.3).float())
    # A mask with no padding at all: one batched causal call, the same result.
    full = torch.ones(3, 24, dtype=torch.long)
    torch.testing.assert_close(dense_attention(query, key, value, full, scale=0.3),
                               reference(query, key, value, None, 0.3).float())
    # The padding lengths given by a caller that knows them (OasisCache reads them once per prefill, not per layer):
    # no host read of the mask, the same result.
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read the mask back"))
    torch.testing.assert_close(dense_attention(query, key, value, mask, scale=0.3, pad_lengths=[0, 5, 24]), out)


def test_masks_the_fast_path_does_not_take_match_too(monkeypatch):
    """A hole in the padding (a real token before a padded one), a query chunk shorter than the keys, and a sliding
    window go through the chunked explicit mask; the per-sequence path returns None for the first and is not tried
    for the others."""
    monkeypatch.setattr(dense, "_MASK_ELEMS", 64)  # several query chunks even at these sizes
    query, key, value = inputs()
    holed = torch.ones(3, 24, dtype=torch.bool)
    holed[0, 3:6] = False
    assert dense._left_padded_prefill(query, key, value, holed, 0.3, True, 0.0) is None
    torch.testing.assert_close(dense_attention(query, key, value, holed, scale=0.3),
                               reference(query, key, value, holed, 0.3).float())
    left = torch.ones(3, 24, dtype=torch.bool)
    left[1, :7] = False
    tried = []
    monkeypatch.setattr(dense, "_left_padded_prefill", lambda *a: tried.append(1))
    torch.testing.assert_close(dense_attention(query[:, :, -5:], key, value, left, scale=0.3),
                               reference(query[:, :, -5:], key, value, left, 0.3).float())
    torch.testing.assert_close(dense_attention(query, key, value, left, scale=0.3, sliding_window=6),
                               reference(query, key, value, left, 0.3, sliding_window=6).float())
    assert tried == []


@pytest.mark.gpu
def test_left_padded_prefill_on_cuda_matches_the_masked_path(monkeypatch):
    """bf16 on CUDA at the accuracy suite's shapes (Qwen2.5-1.5B: 12 query heads, 2 KV heads, head dim 128), 4k
    tokens, three paddings: the unpadded per-sequence kernels against the chunked explicit mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    query, key, value = (torch.randn(3, heads, 4096, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
                         for heads in (12, 2, 2))
    mask = torch.ones(3, 4096, dtype=torch.long, device="cuda")
    mask[1, :1000] = 0
    mask[2, :4095] = 0
    fast = dense_attention(query, key, value, mask, scale=128**-0.5)
    monkeypatch.setattr(dense, "_left_padded_prefill", lambda *a: None)
    masked = dense_attention(query, key, value, mask, scale=128**-0.5)
    torch.testing.assert_close(fast, masked, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_a_query_chunk_shorter_than_the_keys_takes_the_lower_right_causal_kernel(kv_heads, monkeypatch):
    """No padding, T < L (a prefill chunk, a verification forward): one SDPA call with the lower-right causal bias
    (no mask built, no GQA expansion), equal to the position-by-position reference."""
    query, key, value = inputs(kv_heads=kv_heads)
    calls = []
    real = dense.causal_lower_right
    monkeypatch.setattr(dense, "causal_lower_right", lambda *a: calls.append(a) or real(*a))
    for tokens in (2, 7, 23):
        calls.clear()
        q = query[:, :, -tokens:]
        torch.testing.assert_close(dense_attention(q, key, value, None, scale=0.3),
                                   reference(q, key, value, None, 0.3).float())
        assert calls == [(tokens, 24)]


@pytest.mark.gpu
def test_lower_right_causal_chunk_on_cuda_matches_the_masked_path(monkeypatch):
    """bf16 on CUDA, Llama-8B heads (32 query, 8 KV, head dim 128): a 1,024-token chunk over 4,096 keys through the
    fused lower-right causal kernel against the explicit-mask path."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(2, 32, 1024, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(2, 8, 4096, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    fast = dense_attention(query, key, value, None, scale=128**-0.5)
    masked = dense_attention(query, key, value, torch.ones(2, 4096, dtype=torch.bool, device="cuda"),
                             scale=128**-0.5)  # a mask without padding: the explicit path
    torch.testing.assert_close(fast, masked, atol=2e-2, rtol=2e-2)
