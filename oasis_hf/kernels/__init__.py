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

import logging
import os

import torch

logger = logging.getLogger(__name__)

try:  # Triton is optional: CPU-only installs use the twins.
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the install
    TRITON_AVAILABLE = False

#: True when Triton kernels run in the interpreter (read once; Triton itself reads it at decoration time).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_logged: set[str] = set()


def use_triton(tensor: torch.Tensor, backend: str) -> bool:
    """Decide whether to run the Triton kernel or the PyTorch twin for `tensor`.

    ``backend="auto"`` picks Triton for CUDA tensors, ``"torch"`` always the twin, ``"triton"`` always Triton
    (raising when it cannot run: no Triton, or a CPU tensor without ``TRITON_INTERPRET=1``).
    """
    if backend == "torch":
        choice = False
    elif backend == "triton":
        if not TRITON_AVAILABLE:
            raise RuntimeError("kernel_backend='triton' but Triton is not installed: `pip install triton`")
        if not tensor.is_cuda and not INTERPRET:
            raise RuntimeError(
                "kernel_backend='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment before Python "
                "starts; use kernel_backend='auto' or 'torch' for the PyTorch path"
            )
        choice = True
    elif backend == "auto":
        choice = TRITON_AVAILABLE and tensor.is_cuda
    else:
        raise ValueError(f"unknown kernel backend {backend!r}; choose 'auto', 'triton' or 'torch'")
    key = f"{backend}:{tensor.device.type}:{choice}"
    if key not in _logged:
        _logged.add(key)
        logger.info("oasis_hf kernels: backend=%s on %s -> %s", backend, tensor.device, "triton" if choice else "torch")
    return choice


from oasis_hf.kernels.append_tokens import append_tokens, write_tokens  # noqa: E402
from oasis_hf.kernels.copy_rows import copy_rows  # noqa: E402
from oasis_hf.kernels.gather_blocks import gather_blocks  # noqa: E402
from oasis_hf.kernels.plan_blocks import plan_blocks  # noqa: E402
from oasis_hf.kernels.ref import (  # noqa: E402
    SUMMARY_LAYOUT,
    append_tokens_ref,
    copy_rows_ref,
    gather_blocks_ref,
    plan_blocks_ref,
    score_blocks_ref,
    sparse_attention_ref,
    write_tokens_ref,
)
from oasis_hf.kernels.score_blocks import score_blocks  # noqa: E402
from oasis_hf.kernels.sparse_attention import sparse_attention  # noqa: E402

__all__ = [
    "INTERPRET",
    "SUMMARY_LAYOUT",
    "TRITON_AVAILABLE",
    "append_tokens",
    "append_tokens_ref",
    "copy_rows",
    "copy_rows_ref",
    "gather_blocks",
    "gather_blocks_ref",
    "plan_blocks",
    "plan_blocks_ref",
    "score_blocks",
    "score_blocks_ref",
    "sparse_attention",
    "sparse_attention_ref",
    "use_triton",
    "write_tokens",
    "write_tokens_ref",
]
