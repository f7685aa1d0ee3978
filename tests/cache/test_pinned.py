"""Releasing page-locked host buffers never happens inside a CUDA graph capture (it would invalidate the capture)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from oasis_hf.cache import pinned
from oasis_hf.errors import OasisError, UnsupportedError
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded


def test_release_during_capture_is_deferred_then_done(monkeypatch):
    """The unregistration (a device synchronisation) is queued while the thread captures and runs after it."""
    done = []
    monkeypatch.setattr(pinned, "_unregister_now", lambda data, pinning: done.append((data, pinning)))
    monkeypatch.setattr(pinned, "_capturing", lambda: True)
    data = torch.empty(8, dtype=torch.uint8)
    pinning = pinned._Pinning(data, [(0, 8)])
    pinned._unregister(data, pinning)
    assert done == [] and pinned._deferred == [(data, pinning)]
    assert pinned.release_deferred() == 0  # still capturing: nothing happens
    monkeypatch.setattr(pinned, "_capturing", lambda: False)
    assert pinned.release_deferred() == 1
    assert done == [(data, pinning)] and pinned._deferred == []


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister that record their calls; registering `fail_at` fails, and registering
    `hold_at` waits for `release` first."""

    def __init__(self, fail_at: int | None = None, hold_at: int | None = None) -> None:
        self.fail_at, self.hold_at, self.release = fail_at, hold_at, threading.Event()
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 - the CUDA runtime's name
        if ptr == self.hold_at:
            self.release.wait(10)
        if ptr == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def _raise_on_error(code):
    if code:
        raise RuntimeError(f"CUDA error {code}")


@pytest.fixture
def fake_cudart(monkeypatch):
    def install(**kwargs):
        fake = _FakeCudart(**kwargs)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        monkeypatch.setattr(torch.cuda, "check_error", _raise_on_error)
        return fake
    return install


def _pin_threads():
    return [t for t in threading.enumerate() if t.name == "oasis-pin"]


def test_chunked_pinning_locks_every_range_once_in_order_and_unlocks_them_on_release(fake_cudart):
    """A buffer locked in chunks (the host store: one per layer) registers each range once, portable and mapped,
    in address order, after touching its pages; release unregisters every range."""
    fake = fake_cudart()
    buf = pinned.PinnedBuffer(1007, pin=True, chunk_bytes=100)
    base = buf.data.data_ptr()
    assert fake.registered == [(base + o, min(100, 1007 - o), 3) for o in range(0, 1007, 100)]
    assert buf.pinned and torch.count_nonzero(buf.data) == 0  # touched (zeroed) before locking
    buf.ready()
    buf.release()
    assert fake.unregistered == [p for p, _, _ in fake.registered]
    buf.release()  # idempotent
    assert len(fake.unregistered) == 11


def _point_at(monkeypatch, fake, attr: str, offset: int) -> None:
    """Set the fake's `attr` (fail_at / hold_at) to byte `offset` of each buffer as its locking starts."""
    original = pinned._Pinning.run

    def run(self):
        setattr(fake, attr, self.data.data_ptr() + offset)
        original(self)

    monkeypatch.setattr(pinned._Pinning, "run", run)


def test_a_failed_range_unlocks_the_others_and_raises_a_pinned_memory_error(fake_cudart, monkeypatch):
    """In the foreground the constructor raises and unlocks what it locked; in the background `ready` raises, for
    any range, and the locked ranges are unregistered on release."""
    fake = fake_cudart()
    _point_at(monkeypatch, fake, "fail_at", 500)
    with pytest.raises(OasisError, match="ulimit -l"):
        pinned.PinnedBuffer(1000, pin=True, chunk_bytes=100)
    assert len(fake.registered) == 5 and fake.unregistered == [p for p, _, _ in fake.registered]
    fake.registered.clear(), fake.unregistered.clear()
    buf = pinned.PinnedBuffer(1000, pin=True, chunk_bytes=100, background=True)
    with pytest.raises(OasisError, match="page-locking 1000 bytes of host memory failed"):
        buf.ready(900, 100)
    with pytest.raises(MemoryError):
        buf.ready(0, 100)  # the error stands for every range once it happened
    assert len(fake.registered) == 5 and fake.unregistered == []  # until release: kernels may use those ranges
    buf.release()
    assert len(fake.unregistered) == 5 and not _pin_threads()


def test_background_pinning_serves_each_range_once_it_is_locked(fake_cudart, monkeypatch):
    """`ready` for an early range returns while a later one is still being locked; the thread ends with the last
    range; a buffer released mid-way stops locking and unregisters what it locked. The buffer is made under
    inference mode (as a generate call makes the host store), which the pinning thread does not share."""
    fake = fake_cudart()
    _point_at(monkeypatch, fake, "hold_at", 300)
    try:
        with torch.inference_mode():
            buf = pinned.PinnedBuffer(600, pin=True, chunk_bytes=100, background=True)
        buf.ready(0, 300)  # ranges 0-2 are locked; range 3 waits
        assert len(fake.registered) == 3 and _pin_threads()
        waiter = threading.Thread(target=buf.ready, args=(300, 100))
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # still waiting for range 3
        fake.release.set()
        waiter.join(10)
        assert not waiter.is_alive()
        buf.ready()
        assert len(fake.registered) == 6
        buf.release()
        assert len(fake.unregistered) == 6 and not _pin_threads()

        fake.release.clear()
        buf = pinned.PinnedBuffer(600, pin=True, chunk_bytes=100, background=True)
        buf.ready(0, 300)
        threading.Timer(0.2, fake.release.set).start()
        buf.release()  # stops after the range in progress
        assert len(fake.unregistered) - 6 == len(fake.registered) - 6 < 6 and not _pin_threads()
    finally:
        fake.release.set()


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


@pytest.mark.gpu
def test_background_pinned_buffer_is_written_by_the_gpu_once_ready():
    """A buffer locked in chunks on the pinning thread: the GPU writes each range (zero-copy) after `ready`, and
    the host reads back what it wrote; release unregisters every chunk (a second register of the range succeeds)."""
    from oasis_hf.kernels import copy_rows

    buf = pinned.PinnedBuffer(64 << 20, pin=True, chunk_bytes=8 << 20, background=True)
    src = torch.arange(64 << 18, dtype=torch.float32, device="cuda").view(-1, 1024)  # 64 MiB
    dst = buf.view(0, tuple(src.shape), torch.float32)
    rows = torch.arange(src.shape[0], device="cuda") * 1024
    buf.ready()
    copy_rows(src, rows, dst, rows, 1024)
    torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu())
    buf.release()
    ptr = buf.data.data_ptr()
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, 64 << 20, 0))  # was unregistered
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
