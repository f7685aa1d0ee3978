"""`Prefetcher`: a worker thread that runs block-selection jobs off the critical path.

After a layer's decode step, its `OasisLayer` submits a job: score the blocks with the lookahead queries of this
step, plan the delta (wanted minus resident, capped, least important evicted) and gather it from host memory into
the pool, so that the layer's next step finds its blocks resident. The job's GPU work goes on the worker's own CUDA
stream, after an event recorded on the compute stream when the step finished (the step reads the table and pool the
job rewrites). Before the layer's next step, `wait` makes the compute stream wait for the job's completion event
(policy "wait": the attention always sees the job's selection, so output does not depend on timing; a job that is
not finished yet is a counted *late* job and the host time spent waiting is the stall).

On the CPU the same jobs run in the worker thread while the main thread moves on to the next layers (PyTorch
releases the GIL inside its kernels).

A job that needs no host work once launched (a selection job captured as a CUDA graph: one replay) can instead be
`launch`-ed by the calling thread straight onto the worker's stream (`OasisConfig.prefetch_launch="caller"`, the
default): the GPU still runs it beside the compute stream and no thread hand-off (nor GIL contention with the
worker) is paid. The thread remains for eager jobs and for `prefetch_launch="thread"`.

Lifecycle: `start` (idempotent) launches a non-daemon thread; `close` (idempotent) drains it and joins; the class
is a context manager. An `OasisCache` closes its workers when it is closed or collected; a worker whose cache was
never closed also stops by itself when the interpreter exits (it notices the main thread has ended). An exception
in a job is kept and re-raised in the caller, as `PrefetchError`, at the next `wait` or `submit`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oasis_hf.errors import PrefetchError

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass
class Ticket:
    """One submitted job: `done` is set by the worker once the job's work is enqueued (GPU) or finished (CPU)."""

    fn: Callable[[], None]
    ready: torch.cuda.Event | None  # recorded on the compute stream: the job may start after it
    done: threading.Event = field(default_factory=threading.Event)
    finished: torch.cuda.Event | None = None  # recorded on the worker stream after the job's GPU work
    submitted: float = field(default_factory=time.perf_counter)
    queue_wait_s: float = 0.0  # host seconds from submit until the worker started it (queue + GIL hand-off)
    run_s: float = 0.0  # host seconds the job took to run (eager work) or to enqueue (CUDA: launches, replays)


def background_stream(device: torch.device) -> torch.cuda.Stream:
    """A CUDA stream of the highest priority for work that must run *beside* the decode step (selection jobs, the
    delta gather, the host write-back). The step's GEMMs fill every SM; at default priority a job's thread blocks
    queue behind theirs, so the delta gather ran serially with the step (batch 8, 32k tokens on the H200: 13.5 ms
    per step for 9.7 without it). PyTorch instantiates CUDA graphs with per-node priorities, so the kernels captured
    on this stream keep its priority when the graph is replayed."""
    low, high = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device, priority=min(low, high))


class Prefetcher:
    """A worker thread (and, on CUDA, a stream) that runs selection jobs in submission order.

    Parameters
    ----------
    device : the device the jobs' tensors live on (``cuda:N`` gets its own stream; ``cpu`` runs in the thread).
    name : thread name, for debuggers and logs.
    """

    def __init__(self, device: torch.device, name: str = "oasis-prefetch") -> None:
        self.device = torch.device(device)
        self.name = name
        self.stream = background_stream(self.device) if self.device.type == "cuda" else None
        # Inside the whole-step graph a job's gather runs here, after its plan, so the next layer's scoring and
        # plan on `stream` overlap this layer's PCIe transfer instead of queueing behind it.
        self.gather_stream = background_stream(self.device) if self.device.type == "cuda" else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.jobs = 0
        self.late = 0
        self.stall_s = 0.0

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> Prefetcher:
        if self._closed:
            raise PrefetchError("this Prefetcher was closed; create a new OasisCache (or Prefetcher)")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=False)
            self._thread.start()
        return self

    def close(self) -> None:
        """Finish the queued jobs, stop and join the thread. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Prefetcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ jobs
    def submit(self, fn: Callable[[], None]) -> Ticket:
        """Queue `fn` (which enqueues GPU work on the current stream, or computes on the CPU); returns its ticket."""
        self._raise_if_failed()
        if self._closed:
            raise PrefetchError("submit() on a closed Prefetcher; the OasisCache was closed, create a new one")
        self.start()
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        ticket = Ticket(fn, ready)
        self.jobs += 1
        self._queue.put(ticket)
        return ticket

    def launch(self, fn: Callable[[], None]) -> Ticket:
        """Run `fn` now, on this thread, with its GPU work enqueued on the worker's stream after the work already on
        the current stream; returns a ticket that is done on the host (the GPU work is ordered by its event).
        CUDA only: `fn` must not need the host to wait for the GPU (a CUDA graph replay, for example)."""
        self._raise_if_failed()
        if self._closed:
            raise PrefetchError("launch() on a closed Prefetcher; the OasisCache was closed, create a new one")
        if self.stream is None:
            raise PrefetchError(f"Prefetcher.launch needs a CUDA device, this worker runs on {self.device}")
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        ticket = Ticket(None, ready)
        self.jobs += 1
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            fn()
            ticket.finished = torch.cuda.Event()
            ticket.finished.record(self.stream)
        ticket.run_s = time.perf_counter() - t0
        ticket.done.set()
        return ticket

    def wait(self, ticket: Ticket) -> None:
        """Order the caller after `ticket`: host-side until the worker handled it, then the compute stream waits
        for the job's GPU work. Counts a late job and the stall when the worker had not finished yet."""
        if not ticket.done.is_set():
            self.late += 1
            t0 = time.perf_counter()
            while not ticket.done.wait(timeout=1.0):
                if not self.alive:
                    break
            self.stall_s += time.perf_counter() - t0
        self._raise_if_failed()
        if not ticket.done.is_set():
            raise PrefetchError(f"the prefetch worker {self.name!r} stopped without finishing a job")
        if ticket.finished is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket.finished)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PrefetchError(
                f"the prefetch worker {self.name!r} failed: {self._error!r}. The cache's block table may be half "
                "updated, so it cannot continue; create a new OasisCache (set OasisConfig.prefetch=False to run "
                "the same selection inline and see the error where it happens)"
            ) from self._error

    def _run(self) -> None:
        # Set once for the thread (grad mode, current device and stream are thread-local), not per job: the worker
        # holds the GIL for less time per job, which is time the caller's thread gets back. Inference mode: jobs
        # update the cache's tensors in place, which may be inference tensors (made under the caller's
        # inference_mode), and inference mode accepts both kinds.
        with contextlib.ExitStack() as scope:
            scope.enter_context(torch.inference_mode())
            if self.stream is not None:
                scope.enter_context(torch.cuda.device(self.device))
                scope.enter_context(torch.cuda.stream(self.stream))
            self._loop()

    def _loop(self) -> None:
        while True:
            try:
                ticket = self._queue.get(timeout=0.2)
            except queue.Empty:
                if not threading.main_thread().is_alive():  # interpreter exit with the cache never closed
                    return
                continue
            if ticket is _STOP:
                return
            if self._error is not None:  # fail fast: later jobs would build on a broken table
                ticket.done.set()
                continue
            try:
                self._execute(ticket)
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised in the caller
                logger.error("prefetch job failed: %r", exc)
                self._error = exc
            finally:
                ticket.fn = None  # drop the job's references (layer -> cache) so the cache can be collected
                ticket.done.set()
                ticket = None

    def _execute(self, ticket: Ticket) -> None:
        t0 = time.perf_counter()
        ticket.queue_wait_s = t0 - ticket.submitted
        if self.stream is not None:  # the thread's current device and stream are the worker's (see `_run`)
            self.stream.wait_event(ticket.ready)
            ticket.fn()
            ticket.finished = torch.cuda.Event()
            ticket.finished.record(self.stream)
        else:
            ticket.fn()
        ticket.run_s = time.perf_counter() - t0
