"""OasisCache on a model split across devices with accelerate's `device_map` (GPU only).

Each layer's pool, summaries, streams, graphs and prefetch worker live on the device the model runs that layer on;
all layers share one pinned host store.
"""

import pytest
import torch
from accelerate import dispatch_model
from transformers import DynamicCache

from tests._factories import oasis_cache, tiny_model
from tests.test_generate import left_padded

pytestmark = pytest.mark.gpu

LAYERS = 4


def _split(model, devices):
    """Layers in equal consecutive runs over `devices`; embeddings on the first, norm and head on the last."""
    device_map = {f"model.{name}": devices[0] for name, _ in model.model.named_children() if name != "layers"}
    device_map.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    for i in range(LAYERS):
        device_map[f"model.layers.{i}"] = devices[i * len(devices) // LAYERS]
    # main_device: modules mapped to "cpu" compute there (accelerate would otherwise treat them as offloaded
    # weights and run them on the first GPU).
    return dispatch_model(model, device_map=device_map, main_device=devices[0])


def _generate(model, cache, ids, mask, new=24):
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                              do_sample=False, pad_token_id=0).cpu()


def _check_placement(cache, devices, budget):
    per_device = {}
    for layer in cache.oasis_layers:
        assert layer.pool_k.device == layer.summaries.data.device == layer.table.slot_block.device
        per_device.setdefault(layer.pool_k.device, []).append(layer)
        assert layer.pool_k.shape[2] == budget // 16  # the budget holds on every device
        assert int(layer.table.resident_count().max()) <= budget // 16
    assert set(per_device) == {torch.device(d) for d in devices}


@pytest.mark.parametrize("budget", [4096, 128], ids=["budget-covers-context", "small-budget"])
@pytest.mark.parametrize("devices", [("cpu", "cuda:0"), ("cuda:0", "cuda:1")], ids=["cpu+cuda0", "cuda0+cuda1"])
@pytest.mark.parametrize("selector", ["current-query", "lookahead"])
def test_split_model_matches_single_device(devices, budget, selector):
    if "cuda:1" in devices and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on nvidia-h200-x2)")
    ids, mask = left_padded([150, 97])
    fields = dict(budget_tokens=budget, selector=selector, max_fetch_blocks=2)
    # Reference: the whole model on the split's last device (cuda:0 or cuda:1 run the same kernels; the CPU layers
    # of the cpu+cuda0 split compute in fp32 like the GPU ones).
    single = tiny_model("llama", layers=LAYERS, attn="oasis", device="cuda:0")
    ref_cache = oasis_cache(single, **fields)
    ref = _generate(single, ref_cache, ids.cuda(), mask.cuda())

    split = _split(tiny_model("llama", layers=LAYERS, attn="oasis"), devices)
    cache = oasis_cache(split, **fields)
    first = torch.device(devices[0])
    out = _generate(split, cache, ids.to(first), mask.to(first))
    assert torch.equal(out, ref)
    _check_placement(cache, devices, budget)
    if budget == 4096:
        dense = _split(tiny_model("llama", layers=LAYERS), devices)
        assert torch.equal(_generate(dense, DynamicCache(config=dense.config), ids.to(first), mask.to(first)), out)
    stats = cache.stats.summary()
    gpu_layers = [layer for layer in cache.oasis_layers if layer.pool_k.is_cuda]
    assert stats["graph_replays"] > 0 and all(layer.step_graphs.graphs for layer in gpu_layers)
    if selector == "lookahead":
        started = {device for device, runtime in cache.runtimes.items() if runtime.started}
        assert started == {torch.device(d) for d in devices}  # one worker per device
    cache.close()
    ref_cache.close()


def test_host_store_is_pinned_at_its_exact_size():
    """PyTorch's pinned allocator would round each tensor up to a power of two; the store pins exactly its bytes."""
    model = tiny_model("llama", attn="oasis", device="cuda")
    ids, mask = left_padded([150])
    cache = oasis_cache(model, host_capacity_tokens=3 * 64)  # 192 tokens: not a power of two
    _generate(model, cache, ids.cuda(), mask.cuda(), new=4)
    (segment,) = cache.host.segments
    assert segment.buffer.pinned and segment.buffer.data.is_pinned()
    assert segment.buffer.data.numel() == cache.host_nbytes()
    assert all(t.is_pinned() and t.data_ptr() >= segment.buffer.data.data_ptr() for t in segment.keys.values())
    with torch.inference_mode():  # the cache's tensors are inference tensors
        cache.reset()
    assert cache.host.segments == [segment] and segment.buffer.data.is_pinned()  # kept for the next batch
    cache.drop_host_store()
    assert not segment.buffer.data.is_pinned()  # unregistered when released
