"""Errors that name the problem and the fix."""

from __future__ import annotations


class OasisError(RuntimeError):
    """Base class of the errors raised by oasis_hf."""


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at or above 1 (``"3.5 MiB"``, ``"1.50 GiB"``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


class HostMemoryError(OasisError, MemoryError):
    """The host store cannot be allocated: raised before anything is allocated.

    `fits_tokens`, when known, is the longest sequence (prompt plus new tokens, per sequence of the batch) the memory
    left would hold.
    """

    def __init__(self, needed: int, available: int, headroom: int, held_tokens: int, limited: bool = False,
                 fits_tokens: int | None = None) -> None:
        self.needed, self.available, self.headroom, self.fits_tokens = needed, available, headroom, fits_tokens
        if limited:
            where = "is left under OasisConfig.host_memory_limit_bytes"
            fix = "raise OasisConfig.host_memory_limit_bytes"
        else:
            where = f"is available, keeping {format_bytes(headroom)} headroom"
            fix = ("lower OasisConfig.host_memory_headroom_bytes, or set OasisConfig.host_memory_limit_bytes where "
                   "the OS under-reports memory that grows on demand")
        fits = f"; it fits sequences of at most {fits_tokens} tokens" if fits_tokens is not None else ""
        super().__init__(
            f"OasisCache host store needs {format_bytes(needed)} more host memory ({needed} bytes) but only "
            f"{format_bytes(available)} ({available} bytes) {where} (it holds {held_tokens} tokens per sequence "
            f"now{fits}). Lower the batch size or context length, {fix}, or add host memory."
        )


class PinnedMemoryError(OasisError, MemoryError):
    """Host memory was allocated but could not be page-locked (``cudaHostRegister`` refused it)."""


class DeviceMemoryError(OasisError, MemoryError):
    """The GPU block pool cannot be allocated."""


class UnsupportedError(OasisError, ValueError):
    """A model, layer type or generation mode that OasisCache does not handle."""


class PrefetchError(OasisError):
    """The background prefetch worker failed; the cache that owns it cannot continue."""


class RemoteTierError(OasisError):
    """The remote KV tier (Mooncake Store) failed, timed out, or lost a block; the request cannot continue."""
