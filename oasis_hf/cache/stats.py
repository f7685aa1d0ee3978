"""`OasisStats`: counters of what the cache did, kept as device tensors so recording never synchronises."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class OasisStats:
    """Totals over the life of a cache. `summary()` synchronises once and returns plain numbers."""

    prefill_layers: int = 0
    decode_layer_steps: int = 0
    _fetched: torch.Tensor | None = field(default=None, repr=False)
    _prefilled: torch.Tensor | None = field(default=None, repr=False)

    def record_prefill(self, layer_idx: int, valid: torch.Tensor) -> None:
        self.prefill_layers += 1
        count = valid.sum()
        self._prefilled = count if self._prefilled is None else self._prefilled + count

    def record_step(self, layer_idx: int, valid: torch.Tensor) -> None:
        self.decode_layer_steps += 1
        count = valid.sum()
        self._fetched = count if self._fetched is None else self._fetched + count

    def summary(self) -> dict[str, float]:
        fetched = int(self._fetched) if self._fetched is not None else 0
        return {
            "prefill_layers": self.prefill_layers,
            "decode_layer_steps": self.decode_layer_steps,
            "initial_blocks": int(self._prefilled) if self._prefilled is not None else 0,
            "fetched_blocks": fetched,
            "fetched_blocks_per_layer_step": fetched / max(1, self.decode_layer_steps),
        }
