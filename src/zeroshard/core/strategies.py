"""Stage 3's two strategies: how a unit's full buffer is gathered and how its gradient is reduced.

The stage-3 policy (`stage3.py`) decides *when*: prefetch, release, reuse, the end of backward,
the step. A gather strategy decides *how* a unit's full buffer is filled from the shards; a reduce
strategy how a unit's gradient buffer becomes this rank's summed slot, and what happens to the
gradient shards at the accumulation boundary. `core/stages.py` composes them from the spec:

  gather   `Gather` over the policy's Comm, exact or through a weight codec (qwZ's int8 blocks,
           `zeropp/qwz.Int8Weights`); hpZ's `zeropp/hpz.SecondaryGather` wraps it, over a
           secondary group declared once. MiCS gathers plainly over its shard group.
  reduce   `Reduce` (a reduce-scatter over the policy's Comm), or qgZ's
           `zeropp/qgz.HierarchicalReduce`; MiCS wraps either in `mics.ReplicaReduce`.

Both hand back typed handles: a `GatherHandle` (`wait`, whether it is `lossy`, and the encoded
rows it received, `packed_rows`, which hpZ keeps), a `ReduceHandle` (`wait`, `advance`, `steps`).
No strategy reads another's internals: a wrapper uses what the protocol here exposes.

Every collective goes through a `Comm` (dist/comm.py): counted in the ledger, watched by the
desync watchdog.
"""

from __future__ import annotations

import torch

from ..dist import Comm
from .layout import Unit


class GatherHandle:
    """An in-flight gather of a unit's full buffer."""

    def __init__(self, work=None, lossy: bool = False):
        """`work`: the collective's handle (None: nothing in flight); `lossy`: the weights it
        brings are decoded from a lossy encoding, not exact."""
        self.work = work
        self.lossy = lossy

    def wait(self) -> None:
        """Wait until the full buffer holds the unit's weights."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def packed_rows(self) -> torch.Tensor | None:
        """The encoded rows this gather received, once waited (None: an exact gather)."""
        return None


class ReduceHandle:
    """An in-flight reduction: `wait()` finishes it; `steps` > 1 marks a two-step one whose
    `advance()` starts its second step (qgZ: across hosts), which the reducer calls one launch
    before it waits."""

    steps = 1

    def __init__(self, work=None):
        """`work`: the collective's handle (None: nothing was in flight, e.g. a world of one)."""
        self.work = work

    def advance(self) -> None:
        """Start the next step (nothing: one step)."""

    def wait(self) -> None:
        """Wait for the reduction."""
        if self.work is not None:
            self.work.wait()
            self.work = None


class Gather:
    """Stage-3 gather: an all-gather of every rank's shard over the policy's Comm, exact, or
    encoded by `codec` (qwZ) where exact weights are not asked for."""

    def __init__(self, comm: Comm, codec=None):
        """`codec`: a weight codec (`zeropp/qwz.Int8Weights`), or None: always exact."""
        self.comm = comm
        self.codec = codec

    def start(self, flat: torch.Tensor, source: torch.Tensor, unit: Unit,
              exact: bool) -> GatherHandle:
        """Start filling `flat` with `unit`'s weights from this rank's shard `source`; `exact`:
        weights a user reads or modifies (GatheredParameters, close), never encoded."""
        if self.codec is not None and not exact and self.comm.world_size > 1:
            return self.codec.gather(self.comm, flat, source, unit)
        return GatherHandle(self.comm.all_gather(flat, source, async_op=True, unit=unit))

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


class ReduceStrategy:
    """What every reduce strategy answers."""

    def start(self, buffer: torch.Tensor, unit: Unit) -> ReduceHandle:
        """Start summing `buffer` over the ranks into this rank's slot of it."""
        raise NotImplementedError

    def finish_boundary(self, units: list[Unit], grad_shards: dict[int, torch.Tensor]) -> None:
        """The gradient shards of the accumulation window are final (before the step)."""

    def replica_position(self) -> int:
        """Which replica of its shard group this rank is in (0: the first; always 0 unless the
        shards are replicated, as under MiCS). Checkpoints write shards from replica 0 only."""
        return 0

    def close(self) -> None:
        """Release process groups."""


class Reduce(ReduceStrategy):
    """Plain reduction: one reduce-scatter over the policy's Comm."""

    def __init__(self, comm: Comm):
        self.comm = comm

    def start(self, buffer: torch.Tensor, unit: Unit) -> ReduceHandle:
        """Start summing `buffer` over the ranks into this rank's slot of it."""
        return ReduceHandle(self.comm.reduce_scatter(buffer, async_op=True, unit=unit))
