"""Errors that name the problem and the fix."""

from __future__ import annotations


class OasisError(RuntimeError):
    """Base class of the errors raised by oasis_hf."""


class HostMemoryError(OasisError, MemoryError):
    """The host store cannot be allocated: raised before anything is allocated."""

    def __init__(self, needed: int, available: int, headroom: int, held_tokens: int) -> None:
        self.needed, self.available, self.headroom = needed, available, headroom
        super().__init__(
            f"OasisCache host store needs {needed / 2**30:.2f} GiB more host memory ({needed} bytes) but only "
            f"{available / 2**30:.2f} GiB ({available} bytes) is available, keeping "
            f"{headroom / 2**30:.2f} GiB headroom (it holds {held_tokens} tokens per sequence now). Lower the batch "
            "size or context length, lower OasisConfig.host_memory_headroom_bytes, or add host memory."
        )


class DeviceMemoryError(OasisError, MemoryError):
    """The GPU block pool cannot be allocated."""


class UnsupportedError(OasisError, ValueError):
    """A model, layer type or generation mode that OasisCache does not handle."""


class PrefetchError(OasisError):
    """The background prefetch worker failed; the cache that owns it cannot continue."""
