"""Stage 3's two strategies: how a unit's full buffer is gathered and how its gradient is reduced.

The stage-3 policy (`stage3.py`) decides *when*: prefetch, release, reuse, the end of backward,
the step. A gather strategy decides *how* a unit's full buffer is filled from the shards; a reduce
strategy how a unit's gradient buffer becomes this rank's summed slot, and what happens to the
gradient shards at the accumulation boundary. `core/stages.py` composes them from the spec:

  gather   `Gather` (plain), or qwZ's `zeropp/qwz.QuantizedGather`; either may be wrapped by
           hpZ's `zeropp/hpz.SecondaryGather`. MiCS gathers plainly over its shard group.
  reduce   `Reduce` (plain), or qgZ's `zeropp/qgz.HierarchicalReduce`; MiCS wraps either in
           `mics.ReplicaReduce`.

Every collective goes through a `Comm` (dist/comm.py): counted in the ledger, watched by the
desync watchdog.
"""

from __future__ import annotations

import torch

from ..dist import Comm
from .layout import Unit


class Gather:
    """Plain stage-3 gather: an all-gather of every rank's shard over the policy's Comm."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def start(self, flat: torch.Tensor, source: torch.Tensor, unit: Unit, exact: bool):
        """Start filling `flat` with `unit`'s weights from this rank's shard `source`; returns
        `(handle, lossy)`, lossy when the weights are not exact (`exact` asks for exact ones)."""
        return self.comm.all_gather(flat, source, async_op=True, unit=unit), False

    def keep(self, unit: Unit, lossy: bool) -> None:
        """`unit` (gathered, `lossy` or not) is released after its forward and will be needed
        for backward: keep whatever makes that gather cheaper (nothing here)."""

    def released(self, index: int) -> None:
        """Unit `index`'s full buffer was freed."""

    def forget(self, index: int | None = None) -> None:
        """The weights of unit `index` (every unit when None) changed: drop what was kept."""

    def tensors(self) -> list[torch.Tensor]:
        """Parameter copies held now (counted under params on the device)."""
        return []

    def close(self) -> None:
        """Drop what is kept and release process groups."""


class Reduce:
    """Plain reduction: one reduce-scatter over the policy's Comm."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def start(self, buffer: torch.Tensor, unit: Unit):
        """Start summing `buffer` over the ranks into this rank's slot of it; returns the handle
        (one with `advance()` is a two-step reduction the policy keeps one launch longer)."""
        return self.comm.reduce_scatter(buffer, async_op=True, unit=unit)

    def finish_boundary(self, units: list[Unit], grad_shards: dict[int, torch.Tensor]) -> None:
        """The gradient shards of the accumulation window are final (before the step)."""

    def close(self) -> None:
        """Release process groups."""
