"""Do the kvpress baselines lose the suite's answers because the press prunes the question?

The ``whole-prompt`` protocol of `eval.press_baselines` compresses the whole prompt, the context and the question at
its end, to ``--budget`` tokens per layer and KV head in one prefill. kvpress's own pipeline
(``pipeline("kv-press-text-generation")``) compresses the context instead and then prefills the question
uncompressed. This runs prompts of one suite task both ways at the same KV size (``question kept``: the prompt's
last ``--question-tokens`` tokens are prefilled after the compressed rest, which keeps ``budget - question_tokens``
tokens), beside dense, and reports each row's score and, for the whole-prompt rows, the share of the prompt's last
``--question-tokens`` tokens that the press kept (mean over layers and KV heads, and the lowest layer's).

    python -m eval.press_question --model qwen2.5-coder-0.5b-instruct --task niah_single --length 2048 \\
        --samples 8 --budget 512 --out eval/results/press_question_qwen0.5b_2k

Needs kvpress and a transformers it can hook (5.17; see `eval.press_baselines`). Greedy decoding of the compressed
cache with `greedy_continue` (CUDA graphs on CUDA), as the accuracy rows decode it.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from eval._common import code_identity, environment, finish, markdown_table
from eval.press_baselines import make_press, press_prefill
from eval.static_decode import greedy_continue
from eval.tasks import TASKS
from eval.tasks.ruler import generate as task_samples
from eval.tasks.ruler import string_match_all
from oasis_hf import compat, models

logger = logging.getLogger("eval.press_question")

# (label, kvpress press class or None for dense, keep the question uncompressed)
ROWS = [("dense", None, False),
        ("SnapKV, whole prompt", "SnapKVPress", False), ("SnapKV, question kept", "SnapKVPress", True),
        ("expected attention, whole prompt", "ExpectedAttentionPress", False),
        ("expected attention, question kept", "ExpectedAttentionPress", True)]


def prefill(model, ids: torch.Tensor, press, budget: int, tail: int,
            probe: int) -> tuple[DynamicCache, torch.Tensor, list[float]]:
    """The prompt `ids` (1, n) into a `DynamicCache`: dense (``press=None``), compressed whole to `budget` tokens, or
    (``tail > 0``) its first ``n - tail`` tokens compressed to ``budget - tail`` and the last `tail` prefilled after
    them without the press (rotary positions of the full prompt, as kvpress's pipeline places its question).
    Returns the cache, the last logits (1, vocab) and, per layer, the share of the prompt's last `probe` tokens the
    press kept when it compressed the whole prompt (empty otherwise)."""
    shares: list[float] = []
    if press is None:
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, **compat.last_logits_only(model))
        return cache, out.logits[:, -1], shares
    if not tail:
        score = press.score

        def spy(module, hidden_states, keys, values, attentions, kwargs):
            scores = score(module, hidden_states, keys, values, attentions, kwargs)  # (1, kv_heads, n)
            kept = scores.topk(int(keys.shape[2] * (1 - press.compression_ratio)), dim=-1).indices  # as kvpress
            shares.append((kept >= keys.shape[2] - probe).float().sum(-1).mean().item() / probe)
            return scores

        press.score = spy  # an instance attribute over the method, removed below
    try:
        cache, logits = press_prefill(model, ids, press, budget, tail)
    finally:
        press.__dict__.pop("score", None)
    return cache, logits, shares


def run_row(args, model, tokenizer, samples: list[dict], label: str, press_name: str | None, keep: bool) -> dict:
    """One row over the samples: the summed score, and the question-tail retention of whole-prompt presses."""
    press = make_press(press_name, model) if press_name else None
    new_tokens = TASKS[args.task][1]
    score, shares, start = 0.0, [], time.perf_counter()
    for sample in samples:
        ids = tokenizer(sample["input"], return_tensors="pt").input_ids.to(model.device)
        cache, logits, layer_shares = prefill(model, ids, press, args.budget, args.question_tokens if keep else 0,
                                              probe=args.question_tokens)
        shares.extend(layer_shares)
        new = greedy_continue(model, cache, logits.argmax(-1, keepdim=True), position=ids.shape[1],
                              max_new_tokens=new_tokens - 1, eos_token_id=tokenizer.eos_token_id)
        score += string_match_all(tokenizer.decode(new[0], skip_special_tokens=True), sample["outputs"])
    row = {"method": label, f"{args.task} score": f"{score:g}/{len(samples)}", "score": 100.0 * score / len(samples),
           "seconds": round(time.perf_counter() - start, 1)}
    if shares:
        row["question tail kept (mean)"] = sum(shares) / len(shares)
        row["question tail kept (lowest layer)"] = min(shares)
    logger.info("%s: %s", label, row[f"{args.task} score"])
    return row


def main() -> None:
    code_identity()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--task", default="niah_single", choices=sorted(TASKS))
    parser.add_argument("--length", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--budget", type=int, default=512, help="KV tokens per layer and KV head after the prefill")
    parser.add_argument("--question-tokens", type=int, default=64,
                        help="the prompt's tail kept uncompressed in the 'question kept' rows (the suite's questions "
                             "are 21-41 tokens; 64 is SnapKV's window and OasisKV's recent window at blocks of 16)")
    parser.add_argument("--rows", nargs="+", default=None, help="labels (or label prefixes) to run; default all")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not 0 < args.question_tokens < args.budget:
        parser.error(f"--question-tokens {args.question_tokens}: give a positive number below --budget {args.budget}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model, tokenizer = models.load(args.model, device=args.device)
    samples = task_samples(args.task, args.length, args.samples, tokenizer)
    rows = [run_row(args, model, tokenizer, samples, label, press, keep) for label, press, keep in ROWS
            if not args.rows or any(label.startswith(r) for r in args.rows)]
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers {env['transformers']}; "
              f"model {args.model}, {next(model.parameters()).dtype}; {args.samples} `{args.task}` prompts of about "
              f"{args.length} tokens; budget {args.budget} tokens per layer and KV head; question tail "
              f"{args.question_tokens} tokens; `{env['command']}`\n\n")
    columns = ["method", f"{args.task} score", "question tail kept (mean)", "question tail kept (lowest layer)",
               "seconds"]
    finish(args, header + markdown_table(rows, columns), {"env": env, "rows": rows})


if __name__ == "__main__":
    with torch.inference_mode():
        main()
