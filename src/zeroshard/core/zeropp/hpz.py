"""ZeRO++ hpZ (`zero_hpz_partition_size` = P): a secondary parameter shard inside each host, as a
gather strategy wrapping the plain or qwZ one (`SecondaryGather`).

Plain stage 3 gathers every unit twice per micro-step over the whole world, once for forward and
once for backward, so on H hosts both gathers cross the inter-host links. With hpZ each rank also
keeps, between a unit's forward and the optimizer step, a secondary shard: its 1/P slice of the
unit's full buffer inside its group of P consecutive ranks (the host, when P is the ranks per
host, as torchrun numbers them). Any later gather of the unit before the step (its backward, an
activation-checkpoint recompute, the forward of the next micro-step under gradient accumulation)
is then an all-gather within the P-rank group only. The bytes are the same bytes (a copy of what
the forward gathered), so training is bitwise equal to plain stage 3.

Communication plan, per micro-step (P-rank groups from `host_group_comm`):
  1. forward: as stage 3, except a unit that still has a valid secondary shard (a second
     micro-step) is gathered within its P-rank group. When a unit's forward is over and its full
     buffer is released, this rank first copies its 1/P slice of the buffer (no communication).
     Ring cost: Psi x (N-1)/N for the first micro-step of an optimizer step.
  2. backward: units are gathered within the P-rank group from the secondary shards. Ring cost:
     Psi x (P-1)/P, none of it crossing hosts when P divides the ranks per host.
  3. gradients: reduce-scattered over the whole world, as stage 3 (Psi x (N-1)/N).
  4. step: the shards change, so the secondary shards are dropped (their memory goes back before
     the optimizer runs) and the next forward gathers over the whole world again. Loading a
     checkpoint, writing parameters through GatheredParameters, or a reset drops them too.
Memory: up to Psi / P elements per rank in the compute dtype between forward and step (the memory
ledger counts them under params on the device).

With qwZ the forward's gather is int8 (`collectives.py`): the secondary shard is then this
group's share of those packed int8 rows (about 1/4 of the fp32 bytes), and the group's gathers in
step 2 move and decode the packed rows, so backward computes with exactly the weights the forward
decoded (bitwise), from a quarter of the memory and intra-host bytes.
"""

from __future__ import annotations

import warnings

import torch

from ...dist import Comm
from ...config.refusals import HPZ_KEY
from ...dist.groups import blocks, split
from ..layout import Unit
from ..strategies import Gather, GatherHandle


def host_group_comm(comm: Comm, size: int) -> Comm:
    """This rank's Comm over its group of `size` consecutive ranks of `comm`'s world.

    Every rank creates every group, in the same order (`dist.new_group` is collective over the
    whole world). The group's collectives are counted in `comm`'s ledger (its intra-/inter-host
    split from the same node layout) and watched by a desync watchdog with `comm`'s deadline.
    """
    sub = split(comm, blocks(comm.world_size, size))
    if sub.crossing_share > 0 and comm.rank == 0:
        warnings.warn(
            f"{HPZ_KEY}={size} makes groups that span hosts of {sub.layout.ranks_per_host} "
            "ranks (LOCAL_WORLD_SIZE), so backward all-gathers still cross hosts; set it to the "
            "ranks per host or a divisor of it", RuntimeWarning, stacklevel=2)
    return sub


class SecondaryGather(Gather):
    """hpZ around another gather: keeps this rank's 1/P slice of a unit between its forward and the
    step, and gathers the unit inside its P-rank group from it meanwhile."""

    def __init__(self, inner: Gather, host_comm: Comm):
        """`host_comm`: this rank's secondary group (`host_group_comm`, made once by the
        builder); P is its size."""
        super().__init__(inner.comm, inner.codec)
        self.inner = inner
        self.host_comm = host_comm
        self.hpz = host_comm.world_size
        #: unit index -> this rank's 1/P slice of the unit's current full buffer.
        self.secondary: dict[int, torch.Tensor] = {}
        #: units whose secondary shard holds the codec's encoded rows, not weights.
        self.secondary_lossy: set[int] = set()
        #: unit index -> its lossy gather in flight or done, whose encoded rows stay readable
        #: while the unit is gathered.
        self.packed: dict[int, GatherHandle] = {}

    def secondary_bounds(self, unit: Unit) -> tuple[int, int]:
        """`[start, end)` of this rank's secondary shard in the unit's flat buffer."""
        size = unit.padded_numel // self.hpz
        return self.host_comm.rank * size, (self.host_comm.rank + 1) * size

    def start(self, flat: torch.Tensor, source: torch.Tensor, unit: Unit,
              exact: bool) -> GatherHandle:
        """Inside the P-rank group from the secondary shard when there is one (and, for `exact`,
        it holds weights, not encoded rows); otherwise the wrapped gather."""
        secondary = self.secondary.get(unit.index)
        if secondary is None or (exact and unit.index in self.secondary_lossy):
            handle = self.inner.start(flat, source, unit, exact)
            if handle.lossy:
                self.packed[unit.index] = handle
            return handle
        if unit.index in self.secondary_lossy:  # the same decoded weights the forward used
            return self.codec.gather_rows(self.host_comm, flat, secondary,
                                          self.comm.world_size, unit)
        return GatherHandle(self.host_comm.all_gather(flat, secondary, async_op=True, unit=unit))

    def keep(self, unit: Unit, lossy: bool) -> None:
        """Copy this rank's secondary shard out of the gathered unit (no communication): under
        qwZ this group's int8 rows (1/4 of fp32), decoded again on each gather into the very
        weights the forward used."""
        index = unit.index
        if index in self.secondary:
            return
        gather = self.packed.get(index)
        rows = gather.packed_rows() if lossy and gather is not None else None
        if rows is not None:
            per_group = self.comm.world_size // self.hpz
            g = self.host_comm.rank
            packed = rows.view(self.comm.world_size, -1)
            self.secondary[index] = packed[g * per_group:(g + 1) * per_group].clone()
            self.secondary_lossy.add(index)
        else:
            self.secondary[index] = unit.flat[slice(*self.secondary_bounds(unit))].clone()

    def released(self, index: int) -> None:
        """The unit's encoded rows are no longer readable."""
        self.packed.pop(index, None)

    def forget(self, index: int | None = None) -> None:
        """Drop the secondary shards (of one unit, or all): the parameters changed."""
        if index is None:
            self.secondary.clear()
            self.secondary_lossy.clear()
        else:
            self.secondary.pop(index, None)
            self.secondary_lossy.discard(index)

    def secondary_bytes(self) -> int:
        """Bytes of secondary shards held now."""
        return sum(t.numel() * t.element_size() for t in self.secondary.values())

    def tensors(self) -> list[torch.Tensor]:
        """The secondary shards (on the compute device)."""
        return list(self.secondary.values())

    def close(self) -> None:
        """Drop every secondary shard."""
        self.forget()
        self.packed.clear()
        self.inner.close()
