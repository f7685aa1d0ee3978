"""What a cache runs on, per device: the prefetch worker and the side streams of write-back and graph capture.

One `DeviceRuntime` per device a cache's layers live on (several under a ``device_map`` split), made on first use
by `OasisCache.runtime`. The streams are created lazily (never on the CPU) and the worker thread starts on first
use; `close` stops it. The graphs' memory pools are not here: they follow the graphs (`OasisCache.graph_pool`).
"""

from __future__ import annotations

import torch

from oasis_hf.cache.prefetch import Prefetcher, background_stream


class DeviceRuntime:
    """The prefetch worker, the write-back stream and the capture streams of one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._prefetcher: Prefetcher | None = None
        self._writeback: torch.cuda.Stream | None = None
        self._capture: dict[bool, torch.cuda.Stream] = {}

    @property
    def prefetcher(self) -> Prefetcher:
        """The background selection worker of this device, started on first use."""
        if self._prefetcher is None:
            self._prefetcher = Prefetcher(self.device, name=f"oasis-prefetch-{self.device}").start()
        return self._prefetcher

    @property
    def started(self) -> bool:
        """Whether the prefetch worker was started (and not closed since)."""
        return self._prefetcher is not None

    @property
    def writeback_stream(self) -> torch.cuda.Stream:
        """The side stream device-to-host write-back runs on (eagerly, and as a forked branch inside graphs); high
        priority, so it runs beside the step (`background_stream`)."""
        if self._writeback is None:
            self._writeback = background_stream(self.device)
        return self._writeback

    def capture_stream(self, background: bool = False) -> torch.cuda.Stream:
        """The side stream graphs are warmed up and captured on: decode steps at default priority, selection jobs
        (`background`) at high priority, which their replays keep (`background_stream`)."""
        if background not in self._capture:
            self._capture[background] = background_stream(self.device) if background else torch.cuda.Stream(
                self.device)
        return self._capture[background]

    def close(self) -> None:
        """Finish the worker's queued jobs and stop its thread (idempotent)."""
        worker, self._prefetcher = self._prefetcher, None
        if worker is not None:
            worker.close()


def close_all(runtimes: dict[torch.device, DeviceRuntime]) -> None:
    """Close every runtime of a cache (its finalizer and `OasisCache.close`)."""
    for runtime in list(runtimes.values()):
        runtime.close()
    runtimes.clear()
