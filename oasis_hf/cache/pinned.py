"""Page-locked host buffers of exactly the requested size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every request up
to the next power of two: a 20 GiB store pins 32 GiB (pytorch/pytorch#150517). The host store is the largest
allocation of a long-context run, so it allocates ordinary memory and page-locks exactly that range with
``cudaHostRegister`` (portable: every GPU of the process reads it, which a model split across GPUs needs; mapped:
the GPU addresses it through unified virtual addressing, as the zero-copy kernels do).

The registration is undone when the buffer's owner is collected or `PinnedBuffer.release` is called, after the
devices finish the work that may still read it.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
_HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped


class PinnedBuffer:
    """`nbytes` of page-locked host memory as a flat uint8 tensor (``.data``); views of it are pinned too.

    Parameters
    ----------
    nbytes : size in bytes (exact; no rounding).
    pin : page-lock the memory (needs CUDA); ``False`` gives an ordinary (pageable) buffer.

    Raises `RuntimeError` (from the CUDA runtime) when the memory cannot be locked.
    """

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        self._finalizer = None
        if pin and nbytes > 0:
            cudart = torch.cuda.cudart()
            flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
            torch.cuda.check_error(cudart.cudaHostRegister(self.data.data_ptr(), nbytes, flags))
            self.pinned = True
            # The callback holds the tensor, so the memory is unregistered before it can be freed.
            self._finalizer = weakref.finalize(self, _unregister, self.data)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over bytes ``offset ..`` of the buffer (no copy)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Unregister now (idempotent); the memory is freed when the last view is gone."""
        if self._finalizer is not None:
            self._finalizer()


def _unregister(data: torch.Tensor) -> None:
    try:
        # A zero-copy kernel may still read or write the range: let every device finish first.
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(data.data_ptr()))
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be torn down
        logger.debug("cudaHostUnregister failed", exc_info=True)
