"""What `eval.accuracy` runs: its rows (method label -> `OasisLM` / `PressLM` keyword arguments) and its presets."""

from __future__ import annotations

# method label -> OasisLM keyword arguments (budget added per row; dense ignores it). Every row takes the preset's
# batch size: draft-model and prompt-lookup drafts go through `speculative_generate`, batched; a kvpress press
# compresses each prompt of a batch on its own and decodes the compressed caches together (`eval.press_baselines`).
#
# The query-driven OasisKV rows share one selection setting, so that they differ only in where the scoring queries
# come from: blocks of 16 tokens (sink 16, recent window 64), the prefill's first selection from the exact attention
# of the prompt's last 32 queries, a selection memory of decay 0.9, and blocks scored by both summaries (mean keys and
# Quest's per-channel bounds, their softmax shares averaged). Measured on the H200 at 8k tokens, budget 512
# (`eval/results/accuracy_gpu_qwen_1.5b_variants_8k.md`): blocks of 16 instead of 32 took the suite average from 71.7
# to 83.7, the window and memory on top to 84.3; both summaries instead of mean keys took it to 86.0 (16k: 81.0 to
# 83.1; @2048 within 0.2 of mean keys at both lengths). The "block 32" and "mean summaries" rows keep the settings
# of the earlier runs.
SELECTION = dict(block_size=16, prefill_window_tokens=32, score_decay=0.9, summary="mean+minmax")


BLOCK_32 = dict(block_size=32, prefill_window_tokens=0, score_decay=0.0)


#: The library as a user gets it: `OasisConfig()` at the row's budget, nothing else set (blocks of 32, mean keys, the
#: default selector); the suite's selection setting above is not the default, so this row says what the default buys.
DEFAULT_ROW = "OasisKV default (OasisConfig())"


METHODS = {
    "dense": dict(dense=True),
    "static (StreamingLLM)": dict(selector="static"),
    DEFAULT_ROW: dict(selector="current-query"),
    "current-query": dict(selector="current-query", **SELECTION),
    "previous-query": dict(selector="previous-query", **SELECTION),
    "lookahead (prompt lookup 3)": dict(selector="lookahead", prompt_lookup=3, **SELECTION),
    "lookahead (draft model)": dict(selector="lookahead", draft=True, **SELECTION),
    # kvpress presses at the same KV size, under kvpress's own protocols (`eval.press_baselines`): the context
    # compressed and the question and answer cue prefilled after it (query-agnostic), or context and question
    # compressed and the cue after them (query-aware); the uncompressed tail counts inside the budget. Expected
    # attention as kvpress's benchmark registry runs it (AdaKV, epsilon 1e-2) beside the plain press.
    "kvpress SnapKV (query-aware)": dict(press="SnapKVPress", protocol="query-aware"),
    "kvpress SnapKV (query-agnostic)": dict(press="SnapKVPress", protocol="query-agnostic"),
    "kvpress AdaKV SnapKV (query-aware)": dict(press="AdaKVPress(SnapKVPress())", protocol="query-aware"),
    "kvpress AdaKV expected attention (query-aware)": dict(
        press="AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))", protocol="query-aware"),
    "kvpress AdaKV expected attention (query-agnostic)": dict(
        press="AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))", protocol="query-agnostic"),
    "kvpress expected attention (query-aware)": dict(press="ExpectedAttentionPress", protocol="query-aware"),
    # Compactor (Chari & Van Durme 2025: leverage scores of the keys blended with non-causal chunked attention), the
    # query-agnostic leader kvpress 0.5.5 ships that runs here (KVzip needs its tokenizer from the Hub).
    "kvpress Compactor (query-agnostic)": dict(press="CompactorPress", protocol="query-agnostic"),
    # The whole prompt compressed, answer cue included: not a kvpress protocol; the rows of earlier runs.
    "kvpress SnapKV (whole prompt)": dict(press="SnapKVPress", protocol="whole-prompt"),
    "kvpress expected attention (whole prompt)": dict(press="ExpectedAttentionPress", protocol="whole-prompt"),
    # Diagnostic rows, not in the presets (run them with --methods): one summary instead of both (Quest's bounds alone
    # gave more vt and recall_list answers and fewer cwe and fwe than mean keys), and the selection settings one at a
    # time.
    "lookahead (draft model, mean summaries)": dict(selector="lookahead", draft=True,
                                                    **SELECTION | dict(summary="mean")),
    "lookahead (draft model, minmax)": dict(selector="lookahead", draft=True, **SELECTION | dict(summary="minmax")),
    # Every key at 2 bits per channel inside its block's bounds, scored token by token (`summary="quantized"`): the
    # ranking closest to exact attention offline (`eval.rank_summaries`), for more summary bytes and scoring reads.
    "lookahead (draft model, quantized keys)": dict(selector="lookahead", draft=True,
                                                    **SELECTION | dict(summary="quantized")),
    "current-query (quantized keys)": dict(selector="current-query", **SELECTION | dict(summary="quantized")),
    # A synchronous selector holds blocks too long with token-level scores under the setting's memory (recall 0.793
    # at decay 0.9, 0.878 at 0.5, 0.909 without; 0.5B at 4k, docs/results.md "Quantized keys in the cache").
    "current-query (quantized keys, memory 0.5)": dict(selector="current-query",
                                                       **SELECTION | dict(summary="quantized", score_decay=0.5)),
    # The background job after every 2nd forward only: half the jobs beside the step (recall 0.744 -> 0.733 on the
    # CPU, 0.5B at 4k, docs/results.md "Fewer selection jobs").
    "lookahead (draft model, job every 2nd forward)": dict(selector="lookahead", draft=True,
                                                           **SELECTION | dict(selection_interval=2)),
    "lookahead (draft model, block 16, no window, no decay)": dict(selector="lookahead", draft=True, block_size=16,
                                                                   prefill_window_tokens=0, score_decay=0.0),
    "lookahead (draft model, block 32)": dict(selector="lookahead", draft=True, **BLOCK_32),
    "lookahead (draft model, block 32, window 32)": dict(selector="lookahead", draft=True,
                                                         **BLOCK_32 | dict(prefill_window_tokens=32)),
    "lookahead (draft model, block 32, decay 0.9)": dict(selector="lookahead", draft=True,
                                                         **BLOCK_32 | dict(score_decay=0.9)),
    "lookahead (draft model, block 32, window 32, decay 0.9)": dict(
        selector="lookahead", draft=True, **BLOCK_32 | dict(prefill_window_tokens=32, score_decay=0.9)),
    "current-query (block 32)": dict(selector="current-query", **BLOCK_32),
    # Lookahead's background choice corrected inside each step by the step's own queries, at most N blocks fetched
    # synchronously (`OasisConfig.sync_fetch_blocks`): how much of current-query's lead @512 a few blocks buy.
    "lookahead (draft model, sync fetch 2)": dict(selector="lookahead", draft=True, sync_fetch_blocks=2, **SELECTION),
    "lookahead (draft model, sync fetch 8)": dict(selector="lookahead", draft=True, sync_fetch_blocks=8, **SELECTION),
    # The same correction ranked by the selection memory too (`OasisConfig.sync_fetch_memory`): on CPU prompts it
    # moved lookahead's own total of blocks, a third of them inside the step, where the plain one moved 3-4x that.
    "lookahead (draft model, sync fetch 2, memory)": dict(selector="lookahead", draft=True, sync_fetch_blocks=2,
                                                          sync_fetch_memory=True, **SELECTION),
}


#: Label suffix of the rows run with the model's chat template (``--chat-template``).
CHAT_SUFFIX = " [chat template]"


DIAGNOSTIC = [m for m in METHODS if m.startswith("lookahead (draft model, ") or m.endswith("(block 32)")
              or m.endswith("(whole prompt)") or "(quantized keys" in m]


PRESETS = {
    "cpu-smollm2-2k": dict(model="smollm2-135m-instruct", draft=None, lengths=[2000], samples=3, budgets=[256, 512],
                           methods=["dense", "static (StreamingLLM)", "current-query", "previous-query",
                                    "lookahead (prompt lookup 3)"], batch_size=1),
    # The same rows at one budget and one sample per task: a check of the whole machinery that runs on 2 CPU cores in
    # about 6 minutes (351 s measured, model load and suite included); one answer is 11 points of a row's average.
    "cpu-smollm2-2k-quick": dict(model="smollm2-135m-instruct", draft=None, lengths=[2000], samples=1, budgets=[256],
                                 methods=["dense", "static (StreamingLLM)", "current-query", "previous-query",
                                          "lookahead (prompt lookup 3)"], batch_size=1),
    "gpu-qwen-1.5b": dict(model="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
                          lengths=[8192, 16384, 30000], samples=50, budgets=[512, 1024, 2048],
                          methods=[m for m in METHODS if m not in DIAGNOSTIC],
                          batch_size=8),
}


def preset_of(args) -> dict:
    """The preset named by ``--preset`` with the ``--samples/--lengths/--budgets/--methods`` overrides."""
    preset = dict(PRESETS[args.preset])
    for key in ("samples", "lengths", "budgets", "methods"):
        if getattr(args, key):
            preset[key] = getattr(args, key)
    return preset
