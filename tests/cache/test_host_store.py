"""`HostKVStore` transfers: long runs through the copy engines and short ones through the zero-copy kernels land every
row where the store's layout puts it, across segments and for sources in the model's (B, T, H, D) memory layout,
and read back the same."""

from __future__ import annotations

import pytest
import torch

from oasis_hf.cache.host_store import COPY_ENGINE_MIN_RUN_BYTES, HostKVStore, size_class
from oasis_hf.cache.pinned import PinnedPool


def _model_layout(batch: int, tokens: int, heads: int, dim: int, device, dtype) -> torch.Tensor:
    """(B, H, T, D) keys as attention layers get them: a transposed view of a (B, T, H, D) projection output."""
    return torch.randn(batch, tokens, heads, dim, device=device, dtype=dtype).transpose(1, 2)


def test_copy_runs_copies_each_sequence_and_head_run():
    """The copy-engine transfer's indexing, on the CPU: a transposed source (the model's layout) lands head by head
    in a strided view of the store's layout, and a strided store view reads back into a contiguous tensor."""
    torch.manual_seed(0)
    src = _model_layout(3, 11, 2, 4, "cpu", torch.float32)
    store = torch.zeros(3, 2, 20, 4)
    HostKVStore._copy_runs(src, store[:, :, 5:16])
    assert torch.equal(store[:, :, 5:16], src)
    assert not store[:, :, :5].any() and not store[:, :, 16:].any()
    back = torch.empty(3, 2, 11, 4)
    HostKVStore._copy_runs(store[:, :, 5:16], back)
    assert torch.equal(back, src)


def test_size_classes_waste_at_most_an_eighth():
    assert [size_class(n) for n in (1, 7, 8, 9, 17, 501, 504, 512, 513)] == [1, 7, 8, 9, 18, 512, 512, 512, 576]
    assert all(n <= size_class(n) <= n * 1.125 for n in range(1, 5000))


def test_first_segment_is_a_size_class_so_similar_requests_share_a_pool_buffer():
    """A request sizes its store for its prompt plus planned tokens; rounded up to a size class, the next request of
    about the same length (here another max_new_tokens) takes the buffer the first returned to the pool instead of
    page-locking a new one during its prefill. Under a limit the exact size still fits."""
    pool = PinnedPool()

    def store(**kwargs):
        return HostKVStore([0, 1], 2, 2, 8, 16, torch.float32, pin=False, headroom_bytes=0, growth_tokens=256,
                           pool=pool, **kwargs)

    first = store()
    first.ensure_capacity(16000, reserve_tokens=16004)
    assert first.capacity_blocks == 1024  # 16,384 tokens: the size class of the 1,001 blocks asked for
    first.close()  # the buffer goes back to the pool
    second = store()
    second.ensure_capacity(16000, reserve_tokens=16128)
    assert second.capacity_blocks == 1024 and pool.reused == 1
    tight = store(limit_bytes=1001 * second.bytes_per_block() * 2)  # room for exactly the blocks asked for
    tight.ensure_capacity(16000, reserve_tokens=16004)
    assert tight.capacity_blocks == 1001


def test_segment_views_are_made_per_layer_on_first_use():
    """Growing the store makes no per-layer tensors (a prefill's first layer would wait for all of them); a layer's
    K/V views appear when it is first written, over that layer's own bytes, and an unmanaged layer is refused."""
    store = HostKVStore([0, 3, 5], 2, 2, 8, 16, torch.float32, pin=False, headroom_bytes=0, growth_tokens=64)
    store.ensure_capacity(40)
    seg = store.segments[0]
    assert dict(seg.keys) == {} and dict(seg.values) == {}
    rows = torch.randn(2, 2, 40, 8)
    store.write(3, rows, -rows, 0)
    assert sorted(seg.keys) == sorted(seg.values) == [3]
    assert torch.equal(store.read_keys(3, 40), rows)
    per_tensor = seg.keys[3].numel() * 4
    assert seg.keys[3].data_ptr() - seg.buffer.data.data_ptr() == 2 * per_tensor  # layer 3 is the second managed
    assert seg.values[0].data_ptr() - seg.buffer.data.data_ptr() == per_tensor
    with pytest.raises(KeyError):
        seg.keys[1]


@pytest.mark.gpu
@pytest.mark.parametrize("contiguous", [False, True])
def test_long_and_short_writes_land_every_row_across_segments(contiguous, monkeypatch):
    """A prefill-sized write (copy engines, on a side stream as the cache issues it) spanning two segments, then a
    decode-sized one (zero-copy kernel), on two layers: host memory holds exactly the rows written."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    batch, heads, dim, bs, dtype = 3, 2, 128, 16, torch.bfloat16
    run_tokens = COPY_ENGINE_MIN_RUN_BYTES // (dim * dtype.itemsize)
    calls = []  # per copy-engine transfer: whether it wrote to host (its source on the GPU)
    monkeypatch.setattr(HostKVStore, "_copy_runs",
                        staticmethod(lambda s, d, f=HostKVStore._copy_runs: calls.append(s.is_cuda) or f(s, d)))
    store = HostKVStore([0, 5], batch, heads, dim, bs, dtype, pin=True, headroom_bytes=0, growth_tokens=bs)
    store.ensure_capacity(run_tokens + 5 * bs)
    first = store.capacity_blocks * bs  # the first segment, rounded up to its size class
    long, short = first + run_tokens + 3, 9  # the long write reaches past the first segment by more than one run
    store.ensure_capacity(long + short)
    assert len(store.segments) == 2
    written = {}
    for layer in (0, 5):
        k, v = (_model_layout(batch, long + short, heads, dim, device, dtype) for _ in range(2))
        if contiguous:
            k, v = k.contiguous(), v.contiguous()
        written[layer] = (k, v)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            store.write(layer, k[:, :, :long], v[:, :, :long], 0)
            store.write(layer, k[:, :, long:], v[:, :, long:], long)
        torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    assert calls == [True] * (2 * 2 * 2)  # layers x (K, V) x segments: both parts of the long write took the engines
    calls.clear()
    for layer, (k, v) in written.items():
        got_k, got_v = store.read_range(layer, long + short, "cpu")
        assert torch.equal(got_k, k.cpu()) and torch.equal(got_v, v.cpu())
        # Read back to the GPU as a chunked prefill does: long segments through the copy engines, short ones (and a
        # short prefix) through the zero-copy gather.
        for tokens in (long + short, 40):
            got_k, got_v = store.read_range(layer, tokens, device)
            torch.cuda.synchronize(device)
            assert torch.equal(got_k, k[:, :, :tokens]) and torch.equal(got_v, v[:, :, :tokens])
    assert calls == [False] * (2 * 2 * 2)  # the long read-backs, (K, V) x segments per layer; the 40 tokens: kernel
