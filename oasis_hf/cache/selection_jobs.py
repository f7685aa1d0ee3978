"""The selection jobs of one layer (asynchronous selectors: ``lookahead``, ``previous-query``).

After a decode step, a job scores every block with the step's queries (the draft positions included), plans the
capped delta and gathers it from host into the pool, for the layer's next step; that step waits for it (`await_job`)
before it reads the pool. Where a job runs:

- inline on the compute stream (``prefetch=False``), or queued to the device's prefetch worker, whose stream runs
  it beside the next layers (``prefetch=True``): handed to the worker thread, or launched from the caller's thread
  when it is a graph replay (``prefetch_launch="caller"``);
- eagerly (`EagerJob`, whose queries can still shrink to the accepted drafts until it starts: `drop_rejected`) or as
  a CUDA graph per ``T`` (`JobGraph`, when the step was itself a replay; first job of a ``T`` eager, the second
  captures);
- under the ``stale`` policy the job only proposes (`stage`): the next step commits the proposal if the job has
  finished by then (`commit_staged`), and otherwise runs on the blocks already resident.

Inside the whole-step graph (`oasis_hf.DecodeGraph`) the layer forks `job` onto the prefetch stream itself.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

from oasis_hf.cache.capture import capture_graph
from oasis_hf.cache.scoring import block_scores, plan
from oasis_hf.errors import UnsupportedError
from oasis_hf.kernels import INTERPRET

if TYPE_CHECKING:
    from oasis_hf.cache.layer import OasisLayer


class SelectionJobs:
    """The outstanding job, the captured job graphs and the stale policy's proposal of one layer."""

    def __init__(self, layer: OasisLayer) -> None:
        self._layer = weakref.ref(layer)  # the layer owns this object: no cycle
        self.ticket = None  # the outstanding job's prefetch ticket, if any
        self.graphs: dict[int, JobGraph] = {}  # T -> captured job
        self.warm: set[int] = set()  # T values whose graphed job already ran eagerly once
        self._eager: EagerJob | None = None  # the latest eager job (see drop_rejected)
        self._staged: dict[str, torch.Tensor] | None = None  # the stale policy's proposal buffers
        self.stage_pending = False  # a proposal waits to be committed by the next step

    @property
    def layer(self) -> OasisLayer:
        return self._layer()

    # ------------------------------------------------------------------------------------------ the job
    def job(self, query: torch.Tensor, start: torch.Tensor, num_tokens: int, scale: float) -> None:
        """Choose and fetch the blocks of the layer's next step from this step's lookahead queries.

        query : (B, H_q, T, D) this forward's queries; start : 0-d long tensor, the forward's first position.
        Runs on the prefetch worker (its stream) or inline; fixed shapes, no host synchronisation.
        """
        scores, delta = self.choose(query, start, num_tokens, scale)
        if delta is not None:
            self.fetch(delta)
        layer = self.layer
        layer.cache.host.prefetch_hint(layer.layer_idx, scores, layer.table.num_slots)  # remote tier: pull ahead

    def choose(self, query: torch.Tensor, start: torch.Tensor, num_tokens: int,
               scale: float) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """The job's scoring and plan (the table already updated): the block scores and ``(blocks, slots, valid)``,
        each (B, H_kv, N), for `fetch`; no delta under the ``stale`` policy, which only stages a proposal."""
        # No local reference to the cache: this runs on the worker thread, which must never hold the last one (a
        # cache dropped meanwhile is then freed, and its worker stopped, on the thread that dropped it).
        layer = self.layer
        cfg = layer.config
        rows = layer.cache.selector.lookahead_queries(query)
        # The next step's view: everything up to this forward's last token, ``start + num_tokens - 1``.
        scores = block_scores(layer, rows, scale, start, num_tokens=1, start_offset=num_tokens - 1)
        if cfg.prefetch_policy == "stale":
            self.stage(scores)
            return scores, None
        return scores, plan(layer, scores, cfg.max_fetch_blocks)

    def fetch(self, delta: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Gather the planned blocks from host into the layer's pool slots (`choose`'s result)."""
        layer = self.layer
        blocks, slots, valid = delta
        layer.cache.host.fetch(layer.layer_idx, blocks, layer.pool_k, layer.pool_v, slots, valid,
                               layer.config.kernel_backend, self.programs())

    def programs(self) -> int | None:
        """Program cap of the job's gather: `fetch_programs` when the job runs beside the step (prefetch on), none
        when it runs inline on the compute stream (nothing to share the GPU with)."""
        cfg = self.layer.config
        return cfg.fetch_programs if cfg.prefetch else None

    # ------------------------------------------------------------------------------------------ submission
    def submit(self, query, start, num_tokens: int, scale: float, graphed: bool) -> None:
        """Run (prefetch off) or queue (prefetch on) this step's job. `graphed`: the step was a graph replay, so
        `query`/`start` are its static buffers and the job can be a captured graph as well."""
        layer = self.layer
        cfg, cache = layer.config, layer.cache
        cache.stats.prefetch_jobs += 1
        self.stage_pending = cfg.prefetch_policy == "stale"
        cache.host.note_step(layer.layer_idx, layer.length)
        run = self._runner(query, start, num_tokens, scale, graphed and cache.host.capturable_fetch)
        if not cfg.prefetch:
            run()
            return
        if INTERPRET and layer.device.type == "cpu" and cfg.kernel_backend == "triton":
            raise UnsupportedError(
                "kernel_backend='triton' on CPU tensors runs Triton's interpreter, which cannot run kernels from two "
                "threads at once (the prefetch worker and the decode step); set OasisConfig.prefetch=False (jobs "
                "inline) or kernel_backend='auto'"
            )
        prefetcher = cache.runtime(layer.device).prefetcher
        if prefetcher.stream is not None:  # the worker stream reads these after the caller may free them
            query.record_stream(prefetcher.stream)
            start.record_stream(prefetcher.stream)
        if isinstance(run, EagerJob) or cfg.prefetch_launch != "caller":
            self.ticket = prefetcher.submit(run)
        else:  # a graph replay: launched onto the prefetch stream from here, no thread hand-off
            self.ticket = prefetcher.launch(run)

    def _runner(self, query, start, num_tokens: int, scale: float, graphed: bool):
        """A callable doing the job: eager, or the replay of the job captured for this ``T`` (a replay is one launch
        instead of the job's four and its Python)."""
        if not graphed:
            job = self._eager = EagerJob(self, query, start, num_tokens, scale)
            return job
        graph = self.graphs.get(num_tokens)
        if graph is None or graph.scale != scale:
            if num_tokens not in self.warm:
                # The warm-up runs exactly what the capture will (all T queries: not narrowable by drop_rejected),
                # so every Triton specialisation is compiled before it; a compile inside a capture invalidates it.
                self.warm.add(num_tokens)
                return EagerJob(self, query, start, num_tokens, scale)
            self.layer.cache.wait()  # nothing in flight on the worker while capturing
            graph = self.graphs[num_tokens] = JobGraph(self, query, start, num_tokens, scale)
        return graph.graph.replay

    def drop_rejected(self, tokens: int) -> None:
        """The last `tokens` of the latest forward were rejected drafts: if that forward's job has not started yet,
        it scores with the accepted queries only (a job already running or captured as a graph keeps all of them;
        either way the output is exact, only the choice of blocks changes)."""
        job, self._eager = self._eager, None
        if job is not None and job.narrow(tokens):
            self.layer.cache.stats.narrowed_jobs += 1

    def await_job(self) -> None:
        """Wait (host, then stream) for the outstanding job; count it late if unfinished."""
        if self.ticket is None:
            return
        ticket, self.ticket = self.ticket, None
        layer = self.layer
        prefetcher = layer.cache.runtime(layer.device).prefetcher
        late, stall = prefetcher.late, prefetcher.stall_s
        prefetcher.wait(ticket)
        stats = layer.cache.stats
        stats.prefetch_late += prefetcher.late - late
        stats.prefetch_stall_s += prefetcher.stall_s - stall
        stats.prefetch_queue_wait_s += ticket.queue_wait_s
        stats.prefetch_job_host_s += ticket.run_s

    # ------------------------------------------------------------------------------------------ graphs
    def forget_graph(self, num_tokens: int) -> None:
        """Drop the job graph of `num_tokens` (it read the buffers of a step graph that was recaptured)."""
        self.graphs.pop(num_tokens, None)

    def pool(self, device: torch.device):
        """The memory pool of a live job graph on `device`, or None."""
        return next((g.graph.pool() for g in self.graphs.values() if g.device == device), None)

    def clear(self) -> None:
        """Drop every job graph; each ``T`` runs its job eagerly again before the next capture."""
        self.graphs.clear()
        self.warm.clear()

    # ------------------------------------------------------------------------------------------ the stale policy
    def stage(self, scores: torch.Tensor) -> None:
        """Propose the delta without touching the table, and gather the proposed blocks into staging buffers.
        Writes only buffers the step never reads, so the step may run concurrently with it."""
        layer = self.layer
        cfg = layer.config
        blocks, slots, valid, block_scores_ = layer.table.propose(scores, cfg.max_fetch_blocks, cfg.keep_margin)
        width = self._stage_width()
        st = self._staged
        if st is None or st["scores"].shape != scores.shape:
            shape = (layer.batch_size, layer.num_kv_heads, width)
            pool = (*shape, cfg.block_size, layer.head_dim)
            device = layer.device
            st = self._staged = {
                "blocks": torch.zeros(shape, dtype=torch.long, device=device),
                "slots": torch.zeros(shape, dtype=torch.long, device=device),
                "valid": torch.zeros(shape, dtype=torch.bool, device=device),
                "expected": torch.zeros(shape, dtype=torch.long, device=device),
                "block_scores": torch.zeros(shape, dtype=torch.float32, device=device),
                "scores": torch.zeros_like(scores, dtype=torch.float32),
                "k": torch.zeros(pool, dtype=layer.dtype, device=device),
                "v": torch.zeros(pool, dtype=layer.dtype, device=device),
            }
        st["blocks"].copy_(blocks[..., :width])
        st["slots"].copy_(slots[..., :width])
        st["valid"].copy_(valid[..., :width])
        st["expected"].copy_(layer.table.slot_block.gather(-1, slots[..., :width]))
        st["block_scores"].copy_(block_scores_[..., :width])
        st["scores"].copy_(scores)
        entries = layer.arange(width).expand(layer.batch_size, layer.num_kv_heads, -1)
        layer.cache.host.fetch(layer.layer_idx, st["blocks"], st["k"], st["v"], entries, st["valid"],
                               cfg.kernel_backend, self.programs())

    def _stage_width(self) -> int:
        """Proposal entries kept: the fetch cap plus the blocks that are always resident (their misses are forced)."""
        layer = self.layer
        cfg = layer.config
        if cfg.max_fetch_blocks is None:
            return layer.budget_blocks
        return min(layer.budget_blocks, cfg.max_fetch_blocks + cfg.sink_blocks + cfg.recent_blocks)

    def commit_staged(self) -> None:
        """At the start of a step: commit the last job's proposal if it has finished (its entries revalidated against
        the table as it is now), else run on the blocks already resident and count a stale step. Never waits."""
        if not self.stage_pending:
            return
        ticket = self.ticket
        if ticket is not None:
            finished = ticket.done.is_set() and (ticket.finished is None or ticket.finished.query())
            if not finished:
                stats = self.layer.cache.stats
                stats.prefetch_late += 1
                stats.stale_steps += 1
                return  # the next job replaces the proposal; the worker runs jobs in order
            self.await_job()  # does not wait: orders this stream after the job's work
        self.apply_staged()

    def apply_staged(self) -> None:
        """Commit the finished proposal: revalidate its entries, install them, copy their blocks into the pool."""
        layer = self.layer
        self.stage_pending = False
        st = self._staged
        applied = layer.table.commit(st["blocks"], st["slots"], st["valid"], st["expected"], st["block_scores"],
                                     st["scores"])
        index = st["slots"][..., None, None].expand(-1, -1, -1, layer.config.block_size, layer.head_dim)
        keep = applied[..., None, None]
        layer.pool_k.scatter_(2, index, torch.where(keep, st["k"], layer.pool_k.gather(2, index)))
        layer.pool_v.scatter_(2, index, torch.where(keep, st["v"], layer.pool_v.gather(2, index)))
        layer.cache.stats.record_fetched(applied)

    def before_grow(self) -> None:
        """The table is about to be reallocated: commit a pending proposal (it addresses the old capacity), drop
        the staging buffers and the job graphs."""
        self.graphs.clear()
        if self.stage_pending:
            self.await_job()  # the cache waited for every job before growing, so this does not block
            self.apply_staged()
        self._staged = None
        self.warm.clear()


class JobGraph:
    """`SelectionJobs.job` for one ``T``, captured reading the step graph's static query and start buffers.

    Replayed on the prefetch worker's stream (or inline). It has its own memory pool, shared with the other layers'
    job graphs only: jobs run one after another on the worker stream but concurrently with the step graphs.
    """

    def __init__(self, jobs: SelectionJobs, query, start, num_tokens: int, scale: float) -> None:
        layer = jobs.layer
        self.device = layer.device
        self.scale = scale
        self.graph, _ = capture_graph(layer.cache.runtime(self.device).capture_stream(background=True),
                                      lambda: jobs.job(query, start, num_tokens, scale),
                                      pool=layer.cache.graph_pool(self.device, "job"), what="selection job")


class EagerJob:
    """An eager selection job whose query count can still shrink until the worker starts it (`narrow`)."""

    def __init__(self, jobs: SelectionJobs, query, start, num_tokens: int, scale: float) -> None:
        self.jobs, self.query, self.start, self.scale = jobs, query, start, scale
        self.layer = jobs.layer  # alive until the job ran (the jobs object holds its layer weakly)
        self.keep = num_tokens
        self._lock = threading.Lock()
        self._started = False

    def narrow(self, rejected: int) -> bool:
        """Drop the last `rejected` queries if the job has not started; returns whether it did."""
        with self._lock:
            if self._started or rejected <= 0:
                return False
            self.keep = max(1, self.keep - rejected)
            return True

    def __call__(self) -> None:
        with self._lock:
            self._started = True
            keep = self.keep
        query = self.query if keep == self.query.shape[2] else self.query[:, :, :keep]
        self.jobs.job(query, self.start, keep, self.scale)
        self.jobs = self.layer = self.query = self.start = None  # the ticket may outlive the step: drop them
