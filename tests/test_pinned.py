"""Releasing page-locked host buffers never happens inside a CUDA graph capture (it would invalidate the capture)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from oasis_hf.cache import pinned
from oasis_hf.errors import UnsupportedError
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded


def test_release_during_capture_is_deferred_then_done(monkeypatch):
    """The unregistration (a device synchronisation) is queued while the thread captures and runs after it."""
    done = []
    monkeypatch.setattr(pinned, "_unregister_now", lambda data, pointers: done.append((data, pointers)))
    monkeypatch.setattr(pinned, "_capturing", lambda: True)
    data = torch.empty(8, dtype=torch.uint8)
    pinned._unregister(data, [data.data_ptr()])
    assert done == [] and pinned._deferred == [(data, [data.data_ptr()])]
    assert pinned.release_deferred() == 0  # still capturing: nothing happens
    monkeypatch.setattr(pinned, "_capturing", lambda: False)
    assert pinned.release_deferred() == 1
    assert done == [(data, [data.data_ptr()])] and pinned._deferred == []


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister that record their calls; the registration of `fail_at` fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.registered, self.unregistered = fail_at, [], []
        self.lock = threading.Lock()

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA runtime's name
        with self.lock:
            if ptr == self.fail_at:
                return 2  # cudaErrorMemoryAllocation
            self.registered.append((ptr, size, flags))
            return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        with self.lock:
            self.unregistered.append(ptr)
            return 0


def _raise_on_error(code):
    if code:
        raise RuntimeError(f"CUDA error {code}")


def test_chunked_registration_locks_every_range_once_and_undoes_them_on_failure(monkeypatch):
    """A buffer page-locked in chunks (the host store: one per layer) registers each range once, portable and
    mapped, side by side; when one range fails the others are unregistered before the error is raised."""
    base = 1 << 40
    ranges = [(offset, 100) for offset in range(0, 1000, 100)] + [(1000, 7)]
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", _raise_on_error)
    pointers = pinned._register(base, ranges)
    assert sorted(pointers) == [base + o for o, _ in ranges]
    assert sorted(fake.registered) == [(base + o, n, 3) for o, n in ranges] and fake.unregistered == []
    fake = _FakeCudart(fail_at=base + 500)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        pinned._register(base, ranges)
    assert sorted(fake.unregistered) == sorted(p for p, _, _ in fake.registered)
    assert len(fake.registered) == len(ranges) - 1
    assert not [t for t in threading.enumerate() if t.name.startswith("oasis-pin")]  # the workers are gone


def test_capturing_turns_the_cyclic_collector_off_until_the_last_capture_ends():
    """Nested captures (a job graph inside a whole-step capture): the collector is off from the first entry to the
    last exit, then back in the state it had; it stays off after if it was off before."""
    assert gc.isenabled()
    with pinned.capturing():
        assert not gc.isenabled()
        with pinned.capturing():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with pinned.capturing():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="boom"), pinned.capturing():
        raise RuntimeError("boom")
    assert gc.isenabled()


@pytest.mark.gpu
def test_garbage_graph_is_not_destroyed_inside_a_capture():
    """An old CUDA graph only the cyclic collector can free (a closed request's cache, in a reference cycle) while
    allocations inside a new capture would trigger a collection: destroying a graph mid-capture invalidates the
    capture ("operation failed due to a previous error during capture", seen in the accuracy runs); inside
    `capturing` the collection waits until the capture ends."""
    x = torch.ones(4, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x * 3
    cycle = [old]
    cycle.append(cycle)
    del old, cycle
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    thresholds = gc.get_threshold()
    try:
        with torch.cuda.stream(stream), pinned.capturing():
            graph.capture_begin(capture_error_mode="thread_local")
            y = x * 2
            gc.set_threshold(1)
            _ = [[] for _ in range(1000)]  # container allocations: a collection at each, were the collector on
            graph.capture_end()
    finally:
        gc.set_threshold(*thresholds)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
    assert gc.collect() > 0  # the cycle was still there, freed now


@pytest.mark.gpu
def test_pinned_release_inside_a_real_capture():
    """What a garbage collection of an old cache does in the middle of a decode step's capture."""
    buf = pinned.PinnedBuffer(1 << 20, pin=True)
    x = torch.ones(4, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        y = x * 2
        buf.release()
        assert len(pinned._deferred) == 1
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)
    assert pinned.release_deferred() == 1 and not buf.data.is_pinned()


@pytest.mark.gpu
def test_old_caches_collected_during_new_captures():
    """Caches dropped without close() (as a loop of generate calls leaves them) are collected while later caches
    capture their decode steps: every capture must still succeed and give the eager output."""
    model = tiny_model("llama", attn="oasis", device="cuda", dtype=torch.bfloat16)
    ids, mask = left_padded([300, 260])
    ids, mask = ids.cuda(), mask.cuda()
    outs, thresholds = [], gc.get_threshold()
    try:
        for cuda_graphs in (False, True, True, True):
            cache = oasis_cache(model, budget_tokens=128, max_fetch_blocks=2, cuda_graphs=cuda_graphs)
            cycle = [cache]
            cycle.append(cycle)  # a reference cycle: only the cyclic collector frees it, at an arbitrary allocation
            outs.append(generate(model, ids, mask, cache))
            del cache, cycle
            gc.set_threshold(1)  # collect as often as possible, so collections land inside captures
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()
    pinned.release_deferred()
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def _generate(model, ids, mask, cache):
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                              do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_pool_reuses_host_buffers_across_caches_and_closed_caches_refuse_use(device):
    """Caches sharing a PinnedPool reuse the host buffers of closed ones (no new allocation, no new page-locking)
    and decode exactly as caches with their own memory; a closed cache whose memory went back refuses to run."""
    from oasis_hf import PinnedPool

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tiny_model("llama", attn="oasis", device=device, dtype=dtype)
    ids, mask = (t.to(device) for t in left_padded([150, 120], seed=4))
    fields = dict(budget_tokens=128, max_fetch_blocks=2, selector="current-query")
    with oasis_cache(model, **fields) as cache:
        ref = _generate(model, ids, mask, cache)
    pool = PinnedPool()
    first = oasis_cache(model, host_pool=pool, **fields)
    with first:
        assert torch.equal(_generate(model, ids, mask, first), ref)
        pointers = {seg.buffer.data.data_ptr() for seg in first.host.segments}
    assert pool.free_bytes > 0 and first.host.capacity_blocks == 0
    with pytest.raises(UnsupportedError, match="closed"):
        _generate(model, ids, mask, first)
    second = oasis_cache(model, host_pool=pool, **fields)
    with second:
        assert torch.equal(_generate(model, ids, mask, second), ref)
        assert {seg.buffer.data.data_ptr() for seg in second.host.segments} <= pointers
        assert pool.reused >= 1
    pool.clear()
    assert pool.free_bytes == 0
    with pytest.raises(ValueError, match="max_buffers"):
        PinnedPool(max_buffers=0)


def test_pool_keeps_at_most_max_buffers_smallest_released_first():
    from oasis_hf import PinnedPool
    from oasis_hf.cache.pinned import PinnedBuffer

    pool = PinnedPool(max_buffers=2)
    pool.give([PinnedBuffer(n, pin=False) for n in (100, 300, 200)])
    assert pool.free_bytes == 500  # 300 + 200 kept
    assert pool.take(250, pin=False).data.numel() == 300  # the smallest that fits
    assert pool.take(250, pin=False) is None and pool.take(250, pin=True) is None
    assert pool.take(150, pin=False).data.numel() == 200
    assert pool.free_bytes == 0 and pool.reused == 2
