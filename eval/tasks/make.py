"""Write the RULER-style suite for lm-eval: ``python -m eval.tasks.make --out suite --lengths 8192 16384``.

Lengths are counted with the tokenizer of ``--tokenizer`` (a packaged model name, a folder or a Hub id). The YAMLs
name their data by absolute path; after copying or moving a suite folder, ``--relocate FOLDER`` points them at the
folder's own data (`relocate_suite`).
"""

from __future__ import annotations

import argparse
import logging

from eval.tasks.relocate import relocate_suite
from eval.tasks.ruler import TASKS, write_suite
from oasis_hf import models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="folder for the JSONL data and the lm-eval YAMLs")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens")
    parser.add_argument("--samples", type=int, default=50, help="samples per task and length (default 50)")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=None, help="default: all")
    parser.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--relocate", metavar="FOLDER", default=None,
                        help="only point the YAMLs of the suite in FOLDER (copied or moved) at its own data files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.relocate is not None:
        print(f"{relocate_suite(args.relocate)}: the task YAMLs read its data/ folder")
        return
    if args.out is None or args.lengths is None:
        parser.error("--out and --lengths are required (or --relocate FOLDER alone)")
    from transformers import AutoTokenizer

    if args.tokenizer in models.REGISTRY:
        path = models.assemble(args.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    out = write_suite(args.out, tokenizer, args.lengths, args.samples, args.tasks, args.seed)
    print(f"wrote the suite to {out}; run it with: lm_eval ... --include_path {out} --tasks oasis_ruler")


if __name__ == "__main__":
    main()
