"""Kernels: Triton implementations and their pure-PyTorch twins (`oasis_hf.kernels.ref`).

Shape vocabulary used in every docstring and shape comment of the package:

- ``B`` batch, ``H_q`` / ``H_kv`` query / key-value heads, ``G = H_q // H_kv`` (GQA group size)
- ``T`` new (query) tokens in a forward, ``L`` tokens in the cache after the forward
- ``D`` head dim, ``BS`` tokens per block, ``NB`` logical blocks, ``S`` block slots per (sequence, KV head)

Every public kernel ``foo`` (Triton, in ``kernels/foo.py``) has a twin ``foo_ref`` in ``kernels/ref.py`` with the
same signature. The twin is the CPU path and the test oracle. `use_triton` is the one dispatch rule: Triton when
the tensors are on CUDA (or when the caller asks for it explicitly, which under ``TRITON_INTERPRET=1`` runs the
kernel on the CPU), the twin otherwise. This module never touches the Triton driver at import time.
"""

from __future__ import annotations

from oasis_hf.kernels.append_tokens import append_tokens, write_tokens
from oasis_hf.kernels.backend import INTERPRET, TRITON_AVAILABLE, use_triton
from oasis_hf.kernels.block_mass import block_mass
from oasis_hf.kernels.copy_rows import copy_rows
from oasis_hf.kernels.gather_blocks import gather_blocks
from oasis_hf.kernels.plan_blocks import plan_blocks
from oasis_hf.kernels.prefill_blocks import fill_pool, summarize_keys
from oasis_hf.kernels.ref import (
    SUMMARY_LAYOUT,
    append_tokens_ref,
    block_mass_ref,
    copy_rows_ref,
    fill_pool_ref,
    gather_blocks_ref,
    plan_blocks_ref,
    score_blocks_ref,
    sparse_attention_ref,
    summarize_keys_ref,
    write_tokens_ref,
)
from oasis_hf.kernels.score_blocks import score_blocks
from oasis_hf.kernels.sparse_attention import sparse_attention

__all__ = [
    "INTERPRET",
    "SUMMARY_LAYOUT",
    "TRITON_AVAILABLE",
    "append_tokens",
    "append_tokens_ref",
    "block_mass",
    "block_mass_ref",
    "copy_rows",
    "copy_rows_ref",
    "fill_pool",
    "fill_pool_ref",
    "gather_blocks",
    "gather_blocks_ref",
    "plan_blocks",
    "plan_blocks_ref",
    "score_blocks",
    "score_blocks_ref",
    "sparse_attention",
    "sparse_attention_ref",
    "summarize_keys",
    "summarize_keys_ref",
    "use_triton",
    "write_tokens",
    "write_tokens_ref",
]
