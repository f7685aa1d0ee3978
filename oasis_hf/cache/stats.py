"""`OasisStats`: counters of what the cache did, kept as device tensors so recording never synchronises."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

#: The device counters, in their tensor's order: blocks placed by prefills, blocks fetched by selection (a
#: synchronous selector's in-step fetch or an asynchronous one's job), and blocks fetched inside a step by an
#: asynchronous selector's correction (`OasisConfig.sync_fetch_blocks`).
COUNTERS = ("prefilled", "fetched", "corrected")


@dataclass
class OasisStats:
    """Totals over the life of a cache. `summary()` synchronises once and returns plain numbers.

    The block counters are device tensors updated in place, so the updates can sit inside a captured CUDA graph;
    the Python counters are bumped by the caller outside any graph.
    """

    prefill_layers: int = 0
    decode_layer_steps: int = 0
    graph_replays: int = 0
    prefetch_jobs: int = 0  # selection jobs submitted (asynchronous selectors)
    prefetch_late: int = 0  # jobs not finished on the host when their layer's next step needed them
    prefetch_stall_s: float = 0.0  # host seconds spent waiting for late jobs
    prefetch_queue_wait_s: float = 0.0  # host seconds jobs spent queued before the worker started them
    prefetch_job_host_s: float = 0.0  # host seconds the worker (or caller) spent running / enqueueing jobs
    stale_steps: int = 0  # layer-steps that ran on the blocks already resident because their job was late (stale)
    narrowed_jobs: int = 0  # selection jobs that dropped rejected-draft queries before they started
    #: `OasisConfig.measure_recall`, per layer index: [layer-steps measured, attention mass on resident summed,
    #: top-S recall summed].
    layer_recall: dict[int, list[float]] = field(default_factory=dict)
    _counts: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)  # in `COUNTERS` order
    #: Waits for outstanding jobs: a weak reference to the cache's `wait` (the stats must not keep the cache alive),
    #: set by the cache that owns these statistics.
    drain: weakref.WeakMethod | None = field(default=None, repr=False)

    def counters(self, device: torch.device) -> torch.Tensor:
        """The (3,) int64 counter tensor on `device` (`COUNTERS`), created on first use (call it outside graph
        capture)."""
        device = torch.device(device)
        if device not in self._counts:
            # Not an inference tensor even under torch.inference_mode: a cache outlives one call (`OasisCache.reset`)
            # and the next may add to it outside that mode.
            with torch.inference_mode(False):
                self._counts[device] = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        return self._counts[device]

    def counter(self, device: torch.device, name: str) -> torch.Tensor:
        """The (1,) view of counter `name` (one of `COUNTERS`) on `device`, for a kernel to add to in place."""
        index = COUNTERS.index(name)
        return self.counters(device)[index : index + 1]

    def record_prefill(self, layer_idx: int) -> None:
        """One layer's prefill selection (its blocks were added to the ``prefilled`` counter by its plan)."""
        self.prefill_layers += 1

    def record_fetched(self, valid: torch.Tensor) -> None:
        """Add the blocks fetched this step (in place; safe inside graph capture once `counters` exists)."""
        self.counter(valid.device, "fetched").add_(valid.sum())

    def record_recall(self, layer_idx: int, mass_recall: float, topk_recall: float) -> None:
        """One measured layer-step (`OasisConfig.measure_recall`): its mass share and top-S recall."""
        sums = self.layer_recall.setdefault(layer_idx, [0, 0.0, 0.0])
        sums[0] += 1
        sums[1] += mass_recall
        sums[2] += topk_recall

    def summary(self) -> dict[str, Any]:
        """Plain numbers; outstanding selection jobs are waited for first, so their fetches are counted."""
        wait = self.drain() if self.drain is not None else None
        if wait is not None:
            wait()
        steps, mass, topk = (sum(s[i] for s in self.layer_recall.values()) for i in range(3))
        totals = dict.fromkeys(COUNTERS, 0)
        for counts in self._counts.values():
            for name, value in zip(COUNTERS, counts.tolist(), strict=True):
                totals[name] += value
        fetched = totals["fetched"] + totals["corrected"]
        per_step = max(1, self.decode_layer_steps)
        return {
            "prefill_layers": self.prefill_layers,
            "decode_layer_steps": self.decode_layer_steps,
            "graph_replays": self.graph_replays,
            "prefetch_jobs": self.prefetch_jobs,
            "prefetch_late": self.prefetch_late,
            "prefetch_stall_s": self.prefetch_stall_s,
            "prefetch_queue_wait_s": self.prefetch_queue_wait_s,
            "prefetch_job_host_s": self.prefetch_job_host_s,
            "narrowed_jobs": self.narrowed_jobs,
            "stale_steps": self.stale_steps,
            "initial_blocks": totals["prefilled"],
            # Every block moved to the GPU after the prefills, the in-step corrections included; those alone below.
            "fetched_blocks": fetched,
            "fetched_blocks_per_layer_step": fetched / per_step,
            "corrected_blocks": totals["corrected"],
            "corrected_blocks_per_layer_step": totals["corrected"] / per_step,
            "recall_steps": steps,
            "mass_recall": mass / steps if steps else None,
            "topk_recall": topk / steps if steps else None,
            # Per layer index (ascending): the same two shares over that layer's measured steps.
            "layer_mass_recall": {i: s[1] / s[0] for i, s in sorted(self.layer_recall.items())},
            "layer_topk_recall": {i: s[2] / s[0] for i, s in sorted(self.layer_recall.items())},
        }
