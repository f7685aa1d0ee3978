"""Errors that name the problem and the fix."""

from __future__ import annotations


class OasisError(RuntimeError):
    """Base class of the errors raised by oasis_hf."""


class HostMemoryError(OasisError, MemoryError):
    """The host store cannot be allocated: raised before anything is allocated."""

    def __init__(self, needed: int, available: int, headroom: int, held_tokens: int, limited: bool = False) -> None:
        self.needed, self.available, self.headroom = needed, available, headroom
        if limited:
            where = "is left under OasisConfig.host_memory_limit_bytes"
            fix = "raise OasisConfig.host_memory_limit_bytes"
        else:
            where = f"is available, keeping {headroom / 2**30:.2f} GiB headroom"
            fix = ("lower OasisConfig.host_memory_headroom_bytes, or set OasisConfig.host_memory_limit_bytes where "
                   "the OS under-reports memory that grows on demand")
        super().__init__(
            f"OasisCache host store needs {needed / 2**30:.2f} GiB more host memory ({needed} bytes) but only "
            f"{available / 2**30:.2f} GiB ({available} bytes) {where} (it holds {held_tokens} tokens per sequence "
            f"now). Lower the batch size or context length, {fix}, or add host memory."
        )


class DeviceMemoryError(OasisError, MemoryError):
    """The GPU block pool cannot be allocated."""


class UnsupportedError(OasisError, ValueError):
    """A model, layer type or generation mode that OasisCache does not handle."""


class PrefetchError(OasisError):
    """The background prefetch worker failed; the cache that owns it cannot continue."""


class RemoteTierError(OasisError):
    """The remote KV tier (Mooncake Store) failed, timed out, or lost a block; the request cannot continue."""
