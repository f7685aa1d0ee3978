"""Page-locked host buffers of exactly the requested size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator, which rounds every request up
to the next power of two: a 20 GiB store pins 32 GiB (pytorch/pytorch#150517). The host store is the largest
allocation of a long-context run, so it allocates ordinary memory and page-locks exactly that range with
``cudaHostRegister`` (portable: every GPU of the process reads it, which a model split across GPUs needs; mapped:
the GPU addresses it through unified virtual addressing, as the zero-copy kernels do).

The registration is undone when the buffer's owner is collected or `PinnedBuffer.release` is called, after the
devices finish the work that may still read it. That needs a device synchronisation, which must not happen while
the calling thread captures a CUDA graph: the capture would be invalidated (and a collection of an old cache can
run at any allocation, inside a decode step's capture included). A release that arrives during a capture is
therefore deferred and carried out at the next safe point: the end of the capture (the cache's captures run inside
`capturing`), the next buffer allocation, or the next explicit release.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import sys
import threading
import weakref

import torch

from oasis_hf.errors import PinnedMemoryError

logger = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable
_HOST_REGISTER_MAPPED = 0x02  # cudaHostRegisterMapped

_deferred: list[tuple[torch.Tensor, _Pinning]] = []  # buffers whose release arrived during a CUDA graph capture
_deferred_lock = threading.Lock()
_captures = 0  # captures of this package in progress, on any thread (see `capturing`)
_gc_was_enabled = True  # the collector's state when the first of them began


class PinnedBuffer:
    """`nbytes` of page-locked host memory as a flat uint8 tensor (``.data``); views of it are pinned too.

    Parameters
    ----------
    nbytes : size in bytes (exact; no rounding).
    pin : page-lock the memory (needs CUDA); ``False`` gives an ordinary (pageable) buffer.
    chunk_bytes : page-lock the buffer as separate ranges of this many bytes (the last one shorter), in address
        order; ``None`` registers it as one range. Zero-copy kernels may cross chunk boundaries; a ``cudaMemcpy``
        must stay inside one chunk (the host store makes a chunk one layer's K and V). Each chunk's pages are
        touched before it is registered: faulting them in with a parallel fill and locking present pages is about
        three times faster than ``cudaHostRegister`` faulting them in one by one.
    background : page-lock on a thread ("oasis-pin") and return at once; `ready` waits for a range. A long prefill
        then overlaps the locking of the later layers' host memory with the GPU work of the earlier ones.

    Raises `PinnedMemoryError` when the memory cannot be locked: from the constructor (the ranges locked so far
    are unregistered then), or in the background mode from `ready` (they are unregistered on release, after the
    devices finished the work that may use them).
    """

    def __init__(self, nbytes: int, pin: bool, chunk_bytes: int | None = None, background: bool = False) -> None:
        if pin:
            release_deferred()
        if chunk_bytes is not None and chunk_bytes < 1:
            raise ValueError(f"PinnedBuffer chunk_bytes={chunk_bytes} must be positive")
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned = False
        self._finalizer = None
        self._pinning: _Pinning | None = None
        if pin and nbytes > 0:
            step = chunk_bytes or nbytes
            ranges = [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]
            pinning = _Pinning(self.data, ranges)
            if background:
                pinning.start()
            else:
                pinning.run()
                if pinning.error is not None:  # nothing used the buffer yet: unlock at once
                    pinning.unregister()
                    pinning.raise_error()
            self.pinned = True
            self._pinning = pinning
            # The callback holds the tensor, so the memory is unregistered before it can be freed.
            self._finalizer = weakref.finalize(self, _unregister, self.data, pinning)

    def ready(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Wait until bytes ``offset .. offset + nbytes`` (default: to the end) are page-locked; raises
        `PinnedMemoryError` if locking them failed. Immediate for a buffer that is not pinned or done."""
        if self._pinning is not None:
            self._pinning.wait(offset + (self.data.numel() - offset if nbytes is None else nbytes))

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over bytes ``offset ..`` of the buffer (no copy)."""
        nbytes = math.prod(shape) * dtype.itemsize
        return self.data[offset : offset + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Unregister now, or right after the CUDA graph capture in progress on this thread (idempotent); the
        memory is freed when the last view is gone."""
        if self._finalizer is not None:
            self._finalizer()
        release_deferred()


def release_deferred() -> int:
    """Unregister the buffers whose release arrived during a CUDA graph capture; returns how many. Does nothing
    while this thread is capturing. Safe to call at any time."""
    if not _deferred or _capturing():
        return 0
    with _deferred_lock:
        pending = list(_deferred)
        _deferred.clear()
    for data, pinning in pending:
        _unregister_now(data, pinning)
    return len(pending)


@contextlib.contextmanager
def capturing():
    """Mark a CUDA graph capture of this package (enter it before ``capture_begin``, leave it after ``capture_end``).

    - Releases of pinned host memory on any thread (a collection on the prefetch worker, say) wait until it ends;
      `release_deferred` runs on exit.
    - Python's cyclic garbage collector is off meanwhile: a collection triggered by an allocation inside the
      capture would destroy unreachable objects there, among them the CUDA graphs of a cache from an earlier
      request, and destroying a graph is not permitted during a capture (it invalidates it: "operation failed due
      to a previous error during capture"). Reference counting still frees what it frees; the collector runs
      again after the capture."""
    global _captures, _gc_was_enabled
    with _deferred_lock:
        if _captures == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _captures += 1
    try:
        yield
    finally:
        with _deferred_lock:
            _captures -= 1
            if _captures == 0 and _gc_was_enabled:
                gc.enable()
        release_deferred()


def _capturing() -> bool:
    if _captures:
        return True
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class _Pinning:
    """Page-locks the ``(offset, nbytes)`` ranges of `data` in order (portable and mapped), inline or on a thread;
    `wait` blocks until a prefix is locked. Holds no reference to its buffer (its finalizer holds this object)."""

    def __init__(self, data: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        self.data, self.ranges = data, ranges
        self.pointers: list[int] = []  # registered ranges, in order
        self.locked = 0  # bytes locked from offset 0
        self.error: BaseException | None = None
        self.stopped = False
        self.condition = threading.Condition()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="oasis-pin", daemon=True)
        self.thread.start()

    def run(self) -> None:
        cudart = torch.cuda.cudart()
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        base = self.data.data_ptr()
        for offset, size in self.ranges:
            if self.stopped:
                return
            try:
                # Faults the pages in (a parallel fill), then locks them. Inference mode is per thread: a buffer
                # made under it is an inference tensor, which only inference mode may write.
                with torch.inference_mode():
                    self.data[offset : offset + size].zero_()
                torch.cuda.check_error(cudart.cudaHostRegister(base + offset, size, flags))
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                with self.condition:  # the locked ranges stay until release: kernels may be using them
                    self.error = exc
                    self.condition.notify_all()
                return
            with self.condition:
                self.pointers.append(base + offset)
                self.locked = offset + size
                self.condition.notify_all()

    def wait(self, end: int) -> None:
        if self.locked >= end and self.error is None:
            return
        with self.condition:
            while self.locked < end and self.error is None:
                self.condition.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise PinnedMemoryError(
                f"page-locking {self.data.numel()} bytes of host memory failed ({self.error}); lower the batch size "
                "or context length, free host memory, or raise the locked-memory limit (ulimit -l)"
            ) from self.error

    def stop(self) -> None:
        """No further ranges; waits for the one in progress."""
        self.stopped = True
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def unregister(self) -> None:
        with self.condition:
            pointers, self.pointers = self.pointers, []
        for ptr in pointers:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


def _unregister(data: torch.Tensor, pinning: _Pinning) -> None:
    pinning.stop()
    if _capturing():  # a device synchronisation now would invalidate the capture
        with _deferred_lock:
            _deferred.append((data, pinning))
        logger.debug("pinned buffer release deferred until the CUDA graph capture ends")
        return
    _unregister_now(data, pinning)


def _unregister_now(data: torch.Tensor, pinning: _Pinning) -> None:
    try:
        # A zero-copy kernel may still read or write the range: let every device finish first.
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
        pinning.unregister()
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be torn down
        if sys.is_finalizing():
            return
        logger.warning("cudaHostUnregister of a %d-byte host buffer failed; it stays page-locked", data.numel(),
                       exc_info=True)


class PinnedPool:
    """Host buffers kept for reuse by the caches that are given the pool (`OasisCache(..., host_pool=pool)`).

    Page-locking is slow: ``cudaHostRegister`` touches every page, about 2.5 GB/s on the GPU machines here, so a
    fresh cache per request batch (lm-eval, a server) would pin its whole host store every time (6.7 GB at 8 x 30k
    tokens on Qwen2.5-1.5B: seconds per batch). A cache with a pool takes the smallest free buffer that fits each
    host segment and returns its buffers when it is closed (after every device finished the work that may read
    them); a closed cache then refuses further use. The pool keeps at most `max_buffers` free buffers (the
    smallest go first) and releases them all on `clear` or when it is collected.

    Parameters
    ----------
    max_buffers : most free buffers kept (a cache usually holds 1-3 segments).
    """

    def __init__(self, max_buffers: int = 8) -> None:
        if max_buffers < 1:
            raise ValueError(f"PinnedPool(max_buffers={max_buffers}) must keep at least one buffer")
        self.max_buffers = max_buffers
        self._free: list[PinnedBuffer] = []
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again instead of allocated (and pinned) anew

    @property
    def free_bytes(self) -> int:
        """Bytes held by the free buffers."""
        return sum(buffer.data.numel() for buffer in self._free)

    def take(self, nbytes: int, pin: bool) -> PinnedBuffer | None:
        """The smallest free buffer of at least `nbytes` (pinned or not, as asked), removed from the pool; None when
        none fits (the caller allocates one)."""
        with self._lock:
            fits = [b for b in self._free if b.data.numel() >= nbytes and b.pinned == (pin and nbytes > 0)]
            if not fits:
                return None
            best = min(fits, key=lambda b: b.data.numel())
            self._free.remove(best)
            self.reused += 1
            return best

    def give(self, buffers: list[PinnedBuffer]) -> None:
        """Return `buffers` (whose readers have finished) to the pool; beyond `max_buffers` the smallest are
        released."""
        with self._lock:
            self._free.extend(buffers)
            self._free.sort(key=lambda b: b.data.numel(), reverse=True)
            extra, self._free = self._free[self.max_buffers :], self._free[: self.max_buffers]
        for buffer in extra:
            buffer.release()

    def clear(self) -> None:
        """Release every free buffer (unregistered now, or after a capture in progress)."""
        with self._lock:
            free, self._free = self._free, []
        for buffer in free:
            buffer.release()
