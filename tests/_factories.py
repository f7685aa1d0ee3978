"""Tiny random models of the supported families (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import oasis_hf

VOCAB = 128
COMMON = dict(hidden_size=64, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=4096)


def tiny_model(family: str, layers: int = 2, attn: str = "sdpa", device: str = "cpu", dtype=torch.float32):
    """A random model of `family` in eval mode: llama (GQA 2), qwen2 (GQA 4), qwen3 (GQA 1, qk-norm), gemma3
    (3 sliding-window-32 layers + 1 global, one KV head)."""
    torch.manual_seed(1234)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             **COMMON))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
                                             **COMMON))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                             head_dim=16, **COMMON))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                                                   head_dim=16, sliding_window=32, sliding_window_pattern=4,
                                                   **COMMON))
    else:
        raise ValueError(family)
    model = model.to(device=device, dtype=dtype).eval()
    if attn == "oasis":
        oasis_hf.enable(model)
    else:
        model.set_attn_implementation(attn)
    return model


def oasis_cache(model, host_pool=None, **fields) -> oasis_hf.OasisCache:
    """An OasisCache with small blocks so tiny prompts span many blocks."""
    base = dict(block_size=16, sink_tokens=16, recent_tokens=32, budget_tokens=4096)
    base.update(fields)
    return oasis_hf.OasisCache(model.config, oasis_hf.OasisConfig(**base), host_pool=host_pool)


def tiny_tokenizer():
    """A word-level tokenizer over ``w0 .. w{VOCAB-4}`` plus <unk>/<pad>/<eos>, built in memory (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(VOCAB - 3)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    tok.padding_side = "left"
    return tok


def words(n: int, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (n,), generator=gen))
