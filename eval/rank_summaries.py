"""How well block scoring rules rank a real model's blocks, offline: the library's summaries against keys quantized
per token inside each block's range.

    python -m eval.rank_summaries --model qwen2.5-coder-0.5b-instruct --tasks recall_list niah_multivalue vt \
        --context 4096 --samples 2 --new-tokens 24 --device cpu --out eval/results/rank_summaries_qwen0.5b_4k

The model runs once over each suite prompt and its greedy continuation; an attention function registered for that
forward (`AttentionInterface`) receives every layer's post-RoPE queries and keys. For each generated position, layer
and KV head, the exact attention of the position's queries (a GQA group's rows summed) per block of `--block-size`
tokens is the oracle: its top `--selected` blocks among the choosable ones (after `--sink-blocks`, before the
`--recent-blocks` that every policy keeps). Each rule scores the same blocks from what it would keep on the GPU. For
each rule the table gives its top-S recall (the share of the oracle's blocks it picks) and the exact mass its picks
hold, as a share of the mass of the oracle's picks. One position's queries score, as in plain decoding; no cache,
no selection memory, no transfers: this isolates the ranking.

Rules (GPU bytes per key in brackets, at blocks of 16 and 16-bit keys):
- the library's block summaries, scored by its own twin (`score_blocks_ref`): ``mean`` (1/16), ``minmax``
  (Quest's bounds, 2/16), ``mean+minmax`` (3/16);
- ``minmax + b-bit keys`` ((2 + b)/16): every key quantized to ``b`` bits per channel inside its block's [lo, hi]
  (the bounds summary as the range, as KIVI quantizes keys per channel), each token's logit from the dequantized
  key, and a block's score the softmax share of its tokens, summed over the group's rows;
- candidates the library does not have (``--sub-blocks``): ``mean of n sub-blocks`` (n/16), the mean key of each
  of a block's ``n`` equal parts, the block's logit the log-sum-exp of its parts' logits (the block is still the
  unit that is selected and moved); ``mean + variance`` (2/16), the block's logit the log of the expected
  ``exp(scale * q . k)`` if its keys were independent Gaussians per channel: ``scale * q . mean + scale**2 / 2 *
  sum_c q_c**2 var_c``;
- two-stage candidates (``--rerank``): ``mean+minmax`` picks ``k * S`` blocks, and the ``CODE_BITS``-bit keys of those
  blocks rank them. The GPU keeps the summaries and every block's codes, but a step's token pass reads ``k * S``
  blocks' codes instead of all of them. Each row's softmax runs over the candidates' tokens alone, or over every
  token with the other choosable blocks' mass estimated from their mean keys (`RERANK_NORMALISERS`): the rows of a
  group are summed, so a row's normaliser weighs its vote.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from eval._common import code_identity, environment, markdown_table, write_results
from eval.tasks import TASKS
from eval.tasks.ruler import generate as task_samples
from oasis_hf import models
from oasis_hf.cache.scoring import block_mass
from oasis_hf.kernels.ref import CODE_BITS, SUMMARY_LAYOUT, score_blocks_ref, summarize_blocks

logger = logging.getLogger("eval.rank_summaries")

PROBE = "oasis_rank_probe"  # the attention function's name in transformers' registry, registered by `main`


#: How a two-stage rule's softmax is normalised: over the candidates' tokens alone, or over every token with each
#: other block's tokens estimated from its mean key (``BS * exp(logit of the mean)``; sinks and recent blocks by their
#: codes, as the one-stage rule).
RERANK_NORMALISERS = ("softmax over the candidates", "others by their mean keys")

#: The library's block-level summaries; its ``quantized`` summary is the 2-bit row of the quantized keys below.
KINDS = [kind for kind in SUMMARY_LAYOUT if kind != "quantized"]


def rule_names(bits: list[int], block_size: int, sub_blocks: list[int] = (), rerank: list[int] = ()) -> list[str]:
    """Row labels, each with the GPU bytes per key that the rule keeps (16-bit keys)."""
    names = [f"{kind} ({len(SUMMARY_LAYOUT[kind])}/{block_size} of the key bytes)" for kind in KINDS]
    names += [f"minmax + {b}-bit keys ({2 * 16 / block_size + b:g}/16 of the key bytes)" for b in bits]
    names += [f"candidate: mean of {n} sub-blocks ({n}/{block_size} of the key bytes)" for n in sub_blocks]
    names += [f"candidate: mean + variance, Gaussian (2/{block_size} of the key bytes)"]
    return names + [f"candidate: mean+minmax picks {k}S, {CODE_BITS}-bit keys rank them, {norm} "
                    f"({3 * 16 / block_size + CODE_BITS:g}/16 of the key bytes)"
                    for k in rerank for norm in RERANK_NORMALISERS]


def block_scores(query: torch.Tensor, keys: torch.Tensor, scale: float, block_size: int, sink_blocks: int,
                 recent_blocks: int, bits: list[int], sub_blocks: list[int] = (), rerank: list[int] = (),
                 selected: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Exact mass and every rule's scores of the choosable blocks for one position.

    query : (H_kv, G, D) the position's query rows per KV head; keys : (H_kv, N, D), the position last (N - 1).
    `sub_blocks`: part counts of the ``mean of n sub-blocks`` candidates (each must divide `block_size`);
    `rerank`: factors ``k`` of the two-stage candidates, which pick ``k * selected`` blocks first (``-inf`` elsewhere).
    Returns ``(mass, scores)``: mass (H_kv, C) the exact softmax mass per choosable block (rows summed), scores
    {label: (H_kv, C)} in `rule_names` order; C = complete blocks minus sinks and recent ones (may be <= 0).
    """
    if any(n < 1 or block_size % n for n in sub_blocks):
        raise ValueError(f"sub_blocks {list(sub_blocks)}: each count must divide the block size {block_size}")
    num_kv_heads, length, head_dim = keys.shape
    complete = length // block_size
    first, last = sink_blocks, complete - recent_blocks
    q, k = query.float(), keys.float()
    rows = q.reshape(1, -1, 1, head_dim)  # (B=1, H_q, T=1, D), the group's rows in transformers' head order
    every = -(-length // block_size)  # the last block may be partial; only complete blocks are ranked
    mass = block_mass(rows, k[None], scale, torch.tensor([length - 1]), torch.zeros(1, dtype=torch.long),
                      block_size, every)[0, :, :complete]  # the exact mass per block, as the library's oracle has it
    blocks = k[:, : complete * block_size].reshape(1, num_kv_heads, complete, block_size, head_dim)
    ok = torch.ones(1, 1, complete, block_size, dtype=torch.bool)
    names = rule_names(bits, block_size, sub_blocks, rerank)
    scores = {}
    for kind, name in zip(KINDS, names[: len(KINDS)], strict=True):
        # The view ends after the last complete block, so none of them is forced as a recent block.
        summaries = summarize_blocks(kind, blocks, ok)
        scores[name] = score_blocks_ref(
            rows, summaries, None, None,
            torch.zeros(1, dtype=torch.long), torch.tensor(complete * block_size), scale, kind=kind,
            source="summaries", num_tokens=1, block_size=block_size, sink_blocks=0, recent_blocks=0,
        )[0]  # fmt: skip
    lo, hi = blocks[0].amin(2, keepdim=True), blocks[0].amax(2, keepdim=True)
    width = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)

    def token_logits(b: int) -> torch.Tensor:  # (H, G, C, BS): every token's logit against its b-bit key
        levels = 2**b - 1
        dequantized = lo + ((blocks[0] - lo) / width * levels).round() / levels * width
        return torch.einsum("hgd,hcbd->hgcb", q, dequantized) * scale

    for b, name in zip(bits, names[len(KINDS) : len(KINDS) + len(bits)], strict=True):
        shares = torch.softmax(token_logits(b).reshape(num_kv_heads, q.shape[1], -1), dim=-1)
        scores[name] = shares.reshape(num_kv_heads, q.shape[1], complete, block_size).sum((1, 3))
    candidates = names[len(KINDS) + len(bits) : len(names) - len(rerank) * len(RERANK_NORMALISERS)]
    for n, name in zip(sub_blocks, candidates[:-1], strict=True):
        parts = blocks[0].reshape(num_kv_heads, complete, n, block_size // n, head_dim).mean(3)  # (H, C, n, D)
        logits = torch.einsum("hgd,hcnd->hgcn", q, parts).mul(scale).logsumexp(-1)
        scores[name] = logits.softmax(-1).sum(1)
    mean, var = blocks[0].mean(2), blocks[0].var(2, unbiased=False)  # (H, C, D)
    logits = (torch.einsum("hgd,hcd->hgc", q, mean) * scale
              + 0.5 * scale**2 * torch.einsum("hgd,hcd->hgc", q * q, var))
    scores[candidates[-1]] = logits.softmax(-1).sum(1)
    scores = {name: s[:, first:last] for name, s in scores.items()}
    if rerank and last > first:
        stage1 = scores[names[KINDS.index("mean+minmax")]]
        tokens = token_logits(CODE_BITS)  # (H, G, C, BS)
        # A block's tokens as its mean key's logit: their sum of exponentials estimated as BS * exp(mean logit).
        estimate = (torch.einsum("hgd,hcd->hgc", q, mean) * scale)[..., None].expand_as(tokens)
        labels = iter(names[len(names) - len(rerank) * len(RERANK_NORMALISERS) :])
        for k in rerank:
            picked = stage1.topk(min(k * selected, stage1.shape[-1]), dim=-1).indices  # (H, k S)
            chosen = torch.zeros_like(stage1, dtype=torch.bool).scatter_(-1, picked, True)
            candidate = torch.zeros(num_kv_heads, complete, dtype=torch.bool)
            candidate[:, first:last] = chosen
            other = ~candidate  # the other choosable blocks (sinks and recent ones are not)
            other[:, :first], other[:, last:] = False, False
            for norm in RERANK_NORMALISERS:
                if norm == RERANK_NORMALISERS[0]:
                    logits = tokens.masked_fill(~candidate[:, None, :, None], -float("inf"))
                else:
                    logits = torch.where(other[:, None, :, None], estimate, tokens)
                shares = torch.softmax(logits.flatten(2), dim=-1).reshape(tokens.shape).sum((1, 3))[:, first:last]
                scores[next(labels)] = shares.masked_fill(~chosen, -float("inf"))
    return mass[:, first:last], scores


def quality(mass: torch.Tensor, score: torch.Tensor, selected: int) -> tuple[float, float]:
    """(top-S recall, mass share) of `score`'s top `selected` blocks against the exact top blocks of `mass` (both
    (H_kv, C)), averaged over the heads."""
    oracle = mass.topk(selected, dim=-1).indices
    picked = score.topk(selected, dim=-1).indices
    recall = (picked[..., :, None] == oracle[..., None, :]).any(-1).float().mean(-1)
    share = mass.gather(-1, picked).sum(-1) / mass.gather(-1, oracle).sum(-1).clamp_min(1e-30)
    return recall.mean().item(), share.mean().item()


class Probe:
    """The attention function of the measured forward: SDPA's output, and the rules' quality at every position
    from ``first`` on, accumulated per rule (``totals[label] = [recall sum, share sum, count]``)."""

    def __init__(self, args):
        self.args, self.first, self.totals = args, None, {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        a = self.args
        num_kv_heads = key.shape[1]
        for pos in range(self.first, query.shape[2]):
            rows = query[0, :, pos].reshape(num_kv_heads, -1, query.shape[-1])
            mass, scores = block_scores(rows, key[0, :, : pos + 1], module.scaling, a.block_size, a.sink_blocks,
                                        a.recent_blocks, a.bits, a.sub_blocks, a.rerank, a.selected)
            if mass.shape[-1] < 2 * a.selected:
                continue  # too few choosable blocks for the selection to mean anything
            for name, score in scores.items():
                total = self.totals.setdefault(name, [0.0, 0.0, 0])
                recall, share = quality(mass, score, a.selected)
                total[0] += recall
                total[1] += share
                total[2] += 1
        return out


def main() -> None:
    code_identity()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--tasks", nargs="+", default=["recall_list"], choices=sorted(TASKS))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2, help="prompts per task")
    parser.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt: the positions measured")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--selected", type=int, default=14, help="blocks each rule picks (S)")
    parser.add_argument("--sink-blocks", type=int, default=1)
    parser.add_argument("--recent-blocks", type=int, default=4)
    parser.add_argument("--bits", type=int, nargs="*", default=[1, 2], help="key code widths to try")
    parser.add_argument("--sub-blocks", type=int, nargs="*", default=[2, 4],
                        help="part counts of the 'mean of n sub-blocks' candidates (each divides --block-size)")
    parser.add_argument("--rerank", type=int, nargs="*", default=[2, 4],
                        help="factors k of the two-stage candidates: mean+minmax picks k * --selected blocks, their "
                             f"{CODE_BITS}-bit keys rank them")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.selected < 1 or args.block_size < 1 or min(args.bits, default=1) < 1 or min(args.rerank, default=1) < 1:
        parser.error("--selected, --block-size, --bits and --rerank take positive integers")
    if any(n < 1 or args.block_size % n for n in args.sub_blocks):
        parser.error(f"--sub-blocks {args.sub_blocks}: each count must divide --block-size {args.block_size}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AttentionInterface

    model, tokenizer = models.load(args.model, device=args.device)
    probe = Probe(args)
    AttentionInterface.register(PROBE, probe)
    for task in args.tasks:
        for sample in task_samples(task, args.context, args.samples, tokenizer):
            ids = tokenizer(sample["input"], return_tensors="pt").input_ids.to(model.device)
            model.set_attn_implementation("sdpa")
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
            probe.first = ids.shape[1]  # the generated positions (the last token's query never attends)
            model.set_attn_implementation(PROBE)
            with torch.no_grad():
                model(out[:, :-1])
            logger.info("%s: %d prompt tokens, %d generated", task, ids.shape[1], out.shape[1] - ids.shape[1])
    model.set_attn_implementation("sdpa")
    rows = [{"rule": name, "positions x layers": n, f"top-{args.selected} recall": round(r / n, 4),
             "mass of its picks / the oracle's": round(s / n, 4)} for name, (r, s, n) in probe.totals.items()]
    env = environment()
    header = (f"Test configuration: {env.get('gpu', 'cpu')}, torch {env['torch']}, transformers "
              f"{env['transformers']}; model {args.model}, {next(model.parameters()).dtype}; tasks "
              f"{' '.join(args.tasks)} at about {args.context} tokens, {args.samples} prompt(s) each, "
              f"{args.new_tokens} greedy tokens; blocks of {args.block_size}, {args.selected} picked after "
              f"{args.sink_blocks} sink and before {args.recent_blocks} recent block(s); `{env['command']}`\n\n")
    table = header + markdown_table(rows, list(rows[0]) if rows else ["rule"])
    print(table)
    if args.out:
        write_results(args.out, {"env": env, "args": vars(args) | {"out": str(args.out)}, "rows": rows}, table)


if __name__ == "__main__":
    main()
