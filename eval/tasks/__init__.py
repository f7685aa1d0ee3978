"""Long-context evaluation tasks generated locally (RULER-style), written as JSONL plus lm-eval task YAMLs."""

from eval.tasks.relocate import relocate_suite
from eval.tasks.ruler import TASKS, filler_sentences, generate, process_results, string_match_all, write_suite

__all__ = ["TASKS", "filler_sentences", "generate", "process_results", "relocate_suite", "string_match_all",
           "write_suite"]
