"""`CacheSlot`: one `OasisCache` handed out batch after batch, reset in between, for callers that run many
``generate`` calls with one configuration (the text-generation pipeline, the lm-eval model, a server loop).

`OasisCache.reset` keeps the GPU buffers, the local host store and the captured graphs, so a batch of the shape the
previous one had allocates and captures nothing: its first decode step replays the whole-step graph the previous
batch captured instead of running one eager forward and one capture (about 0.1 s per call on Qwen2.5-1.5B at 16k).
A batch of another size reallocates at its first forward (`OasisCache.reset`). The host store keeps the largest
size a batch needed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from oasis_hf.cache.oasis_cache import OasisCache
from oasis_hf.cache.pinned import PinnedPool
from oasis_hf.config import OasisConfig

logger = logging.getLogger(__name__)


class CacheSlot:
    """Hands out one `OasisCache` per ``with slot.cache() as cache:`` block, the same object each time, reset when
    the block ends. A block that raised closes its cache (the next one makes a new cache). One block at a time: a
    second, concurrent one is refused.

    >>> slot = CacheSlot(model.config, OasisConfig(budget_tokens=2048))
    >>> for batch in batches:
    ...     with slot.cache() as cache:
    ...         model.generate(**batch, past_key_values=cache, max_new_tokens=64)
    >>> slot.close()
    """

    def __init__(self, model_config, config: OasisConfig | None = None, *, host_pool: PinnedPool | None = None) -> None:
        self.model_config = model_config
        self.config = config or OasisConfig()
        self.host_pool = host_pool
        self._cache: OasisCache | None = None
        self._lock = threading.Lock()

    @property
    def current(self) -> OasisCache | None:
        """The cache the blocks get (None before the first block, after `close`, and after a block that raised)."""
        return self._cache

    @contextlib.contextmanager
    def cache(self) -> Iterator[OasisCache]:
        """The slot's cache, empty, for the duration of the block (made on first use)."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this CacheSlot's cache is in use by another block; a cache holds one batch at a time: "
                               "make a CacheSlot per concurrent caller")
        try:
            if self._cache is None:
                self._cache = OasisCache(self.model_config, self.config, host_pool=self.host_pool)
            cache = self._cache
            try:
                yield cache
            except BaseException:
                # A failed batch (an out-of-memory, a dead worker, an interrupt) discards its cache: the next block
                # starts from a new one rather than from whatever state the failure left.
                self._cache = None
                try:
                    cache.close()
                except Exception:  # noqa: BLE001 - the block's own error is the one to raise
                    logger.debug("closing the cache of a failed batch", exc_info=True)
                raise
            cache.reset()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Close the cache (its host memory goes back to the pool, its worker threads stop); a later block makes a
        new one."""
        cache, self._cache = self._cache, None
        if cache is not None:
            cache.close()
