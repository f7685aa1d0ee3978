"""Releasing page-locked host buffers never happens inside a CUDA graph capture (it would invalidate the capture)."""

from __future__ import annotations

import gc

import pytest
import torch

from oasis_hf.cache import pinned
from tests._factories import oasis_cache, tiny_model
from tests.test_generate import generate, left_padded


def test_release_during_capture_is_deferred_then_done(monkeypatch):
    """The unregistration (a device synchronisation) is queued while the thread captures and runs after it."""
    done = []
    monkeypatch.setattr(pinned, "_unregister_now", done.append)
    monkeypatch.setattr(pinned, "_capturing", lambda: True)
    data = torch.empty(8, dtype=torch.uint8)
    pinned._unregister(data)
    assert done == [] and pinned._deferred == [data]
    assert pinned.release_deferred() == 0  # still capturing: nothing happens
    monkeypatch.setattr(pinned, "_capturing", lambda: False)
    assert pinned.release_deferred() == 1
    assert done == [data] and pinned._deferred == []


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
