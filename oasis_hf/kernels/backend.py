"""The one dispatch rule of the kernels: Triton or the PyTorch twin (`use_triton`), and what decides it."""

from __future__ import annotations

import functools
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
    # Not while torch.compile traces: a log call there is a graph break, and the set it fills would make the traced
    # code depend on which calls ran before it (each new entry fails the guards and recompiles).
    if key not in _logged and not torch.compiler.is_compiling():
        _logged.add(key)
        logger.info("oasis_hf kernels: backend=%s on %s -> %s", backend, tensor.device, "triton" if choice else "torch")
    return choice


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA `device` (the kernels size their grids by it)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
