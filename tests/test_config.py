import dataclasses

import pytest

from oasis_hf import OasisConfig

BAD = [
    ("block_size", 24, "power of two"),
    ("block_size", 8, "power of two"),
    ("block_size", "32", "expected an int"),
    ("budget_tokens", 100, "multiple of block_size"),
    ("budget_tokens", 0, "positive multiple of block_size"),
    ("budget_tokens", -64, "positive multiple of block_size"),
    ("budget_tokens", 128, "sink_tokens \\+ recent_tokens"),
    ("sink_tokens", -32, "non-negative multiple"),
    ("recent_tokens", 33, "multiple of block_size"),
    ("selector", "lookahed", "choose one of"),
    ("summary", "4bit", "choose one of"),
    ("kernel_backend", "cuda", "choose one of"),
    ("max_fetch_blocks", 0, "positive int"),
    ("fetch_programs", 0, "positive int"),
    ("fetch_programs", True, "positive int"),
    ("host_capacity_tokens", -1, "positive int"),
    ("host_capacity_tokens", True, "positive int"),
    ("host_growth_tokens", 0, "positive"),
    ("pin_host_memory", "yes", "True, False or None"),
    ("pin_host_memory", 1, "True, False or None"),
    ("pin_host_memory", 0, "True, False or None"),
    ("host_memory_headroom_bytes", -5, "non-negative"),
    ("host_memory_headroom_bytes", True, "non-negative"),
    ("host_memory_limit_bytes", 0, "positive int"),
    ("dense_chunk_tokens", 0, "positive int"),
    ("prefetch_policy", "late", "'wait' or 'stale'"),
    ("prefetch_launch", "auto", "'thread' or 'caller'"),
    ("cuda_graphs", 1, "True or False"),
    ("prefill_window_tokens", -1, "non-negative int"),
    ("prefill_window_tokens", 1.5, "non-negative int"),
    ("score_decay", 1.0, "in \\[0, 1\\)"),
    ("score_decay", -0.1, "in \\[0, 1\\)"),
    ("score_decay", "0.9", "in \\[0, 1\\)"),
    ("compile_mode", "reduce-overhead", "CUDA graphs of their own"),
    ("compile_mode", "max-autotune", "CUDA graphs of their own"),
    ("compile_mode", "max-autotune-no-cudagraphs", "set that too"),  # without compile_model=True
    ("sync_fetch_blocks", -1, "non-negative int"),
    ("sync_fetch_blocks", True, "non-negative int"),
    ("sync_fetch_blocks", 2, "selects inside the step already"),  # the default selector is current-query
    ("selection_interval", 0, "positive int"),
    ("selection_interval", 1.5, "positive int"),
    ("selection_interval", 2, "selects inside every step"),  # the default selector is current-query
    ("sync_fetch_memory", 1, "True or False"),
    ("sync_fetch_memory", True, "set sync_fetch_blocks > 0"),  # no correction to rank
    ("keep_margin", -0.5, "finite float >= 0"),
    ("keep_margin", float("inf"), "finite float >= 0"),
    ("keep_margin", float("nan"), "finite float >= 0"),
    ("keep_margin", True, "finite float >= 0"),
    ("quantized_rerank", -1, "non-negative int"),
    ("quantized_rerank", 2.0, "non-negative int"),
    ("quantized_rerank", True, "non-negative int"),
]


@pytest.mark.parametrize(("field", "value", "why"), BAD)
def test_invalid_field_names_field_and_value(field, value, why):
    with pytest.raises(ValueError, match=why) as err:
        OasisConfig(**{field: value})
    assert f"OasisConfig.{field}={value!r}" in str(err.value)


def test_frozen_roundtrip_and_unknown_keys():
    cfg = OasisConfig(budget_tokens=1024)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget_tokens = 512
    assert OasisConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown OasisConfig field"):
        OasisConfig.from_dict({"budget": 1024})
    assert cfg.budget_blocks == 32 and cfg.sink_blocks == 1 and cfg.recent_blocks == 5


def test_selection_interval_is_for_asynchronous_selectors():
    for selector in ("lookahead", "previous-query"):
        assert OasisConfig(selector=selector, selection_interval=4).selection_interval == 4
    with pytest.raises(ValueError, match="selects inside every step"):
        OasisConfig(selector="oracle", selection_interval=2)


def test_pinned_host_memory_without_cuda_is_refused_when_the_config_is_made():
    import torch

    if torch.cuda.is_available():
        assert OasisConfig(pin_host_memory=True).pin_host_memory is True
        return
    with pytest.raises(ValueError, match="OasisConfig.pin_host_memory=True .*no CUDA device.*None"):
        OasisConfig(pin_host_memory=True)
    assert OasisConfig(pin_host_memory=False).pin_host_memory is False


def test_a_cache_names_the_argument_it_expected():
    from oasis_hf import OasisCache
    from tests._factories import tiny_model

    model = tiny_model("llama")
    with pytest.raises(TypeError, match="PretrainedConfig.*got LlamaForCausalLM \\(pass model.config\\)"):
        OasisCache(model)
    with pytest.raises(TypeError, match="PretrainedConfig.*got NoneType"):
        OasisCache(None)
    with pytest.raises(TypeError, match="must be an OasisConfig.*got dict"):
        OasisCache(model.config, {"budget_tokens": 1024})
    assert OasisCache(model.config, budget_tokens=1024).config.budget_tokens == 1024


def test_block_geometry_rounds_up_in_one_place():
    cfg = OasisConfig(block_size=32)
    assert [cfg.blocks(n) for n in (0, 1, 32, 33, 64, 65)] == [0, 1, 1, 2, 2, 3]


def test_score_candidates_are_k_times_the_selected_blocks_plus_the_forced_ones():
    # Budget 2048 in blocks of 32: 64 slots, 1 sink block and 5 recent ones (4 + the last, partial one): S = 58.
    cfg = OasisConfig(summary="quantized", quantized_rerank=4, sink_tokens=32, recent_tokens=128)
    forced_one_token = 1 + 5 + 1 + 1
    assert cfg.score_candidates(0, 1) == 4 * 58 + forced_one_token
    assert cfg.score_candidates(0, 40) == 4 * 58 + 1 + 5 + 2 + 1  # 40 new tokens can touch two more blocks
    assert dataclasses.replace(cfg, quantized_rerank=0).score_candidates(0, 1) == 0  # one stage: every block
    assert dataclasses.replace(cfg, summary="mean+minmax").score_candidates(0, 1) == 0
