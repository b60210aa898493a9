"""ZeRO++ hpZ (`zero_hpz_partition_size` = P): a secondary parameter shard inside each host.

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

With qwZ the forward's gather is int8 (`quantized_comm.py`): the secondary shard is then this
group's share of those packed int8 rows (about 1/4 of the fp32 bytes), and the group's gathers in
step 2 move and decode the packed rows, so backward computes with exactly the weights the forward
decoded (bitwise), from a quarter of the memory and intra-host bytes.
"""

from __future__ import annotations

import warnings

import torch

from ..dist import Comm
from ..config.refusals import HPZ_KEY
from .groups import blocks, split
from .layout import Unit
from .quantize import WEIGHT_BLOCK
from .quantized_comm import packed_all_gather
from .stage3 import Stage3


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


class Stage3HPZ(Stage3):
    """Stage 3 plus secondary shards: gathers between a unit's forward and the step stay in its
    P-rank group."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hpz = self.options.hpz_partition_size
        self.host_comm = host_group_comm(self.comm, self.hpz)
        #: unit index -> this rank's 1/P slice of the unit's current full buffer.
        self.secondary: dict[int, torch.Tensor] = {}
        #: units whose secondary shard holds qwZ's int8 rows (`quantized_comm.py`), not weights.
        self.secondary_lossy: set[int] = set()
        self.keeps_packed = True

    def secondary_bounds(self, unit: Unit) -> tuple[int, int]:
        """`[start, end)` of this rank's secondary shard in the unit's flat buffer."""
        size = unit.padded_numel // self.hpz
        return self.host_comm.rank * size, (self.host_comm.rank + 1) * size

    # -- the secondary shard's life: kept after forward, used by gathers, dropped at the step ------
    def _release_after_forward(self, index: int, wants_backward: bool) -> None:
        unit = self.by_index[index]
        # An engine without an optimizer never steps, so it would never drop them: keep none.
        if self.keeps_gradients and wants_backward and index not in self.secondary and \
                index in self.sharded and \
                unit.is_gathered and index not in self.pending and not self.pinned.get(index):
            gather = self.packed.get(index)
            if index in self.lossy and gather is not None and gather.rows_packed is not None:
                # qwZ: keep this group's int8 rows (1/4 of fp32), decoded again on each gather
                # into the very weights the forward used.
                rows = self.comm.world_size // self.hpz
                g = self.host_comm.rank
                packed = gather.rows_packed.view(self.comm.world_size, -1)
                self.secondary[index] = packed[g * rows:(g + 1) * rows].clone()
                self.secondary_lossy.add(index)
            else:
                self.secondary[index] = unit.flat[slice(*self.secondary_bounds(unit))].clone()
        super()._release_after_forward(index, wants_backward)

    def _issue(self, unit: Unit, exact: bool = False) -> None:
        secondary = self.secondary.get(unit.index)
        if secondary is None or unit.index in self.pending or unit.is_gathered or \
                (exact and unit.index in self.secondary_lossy):
            super()._issue(unit, exact)
            return
        if unit.index in self.secondary_lossy:
            self.lossy.add(unit.index)  # the same decoded weights the forward used
        flat = unit.allocate(self.gathered_pool)
        self.live_numel += unit.padded_numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        with self.streams.on("gather"):
            if unit.index in self.secondary_lossy:
                handle = packed_all_gather(self.host_comm, flat, secondary, self.comm.world_size,
                                           unit, self._block_plan(unit, WEIGHT_BLOCK))
            else:
                handle = self.host_comm.all_gather(flat, secondary, async_op=True, unit=unit)
        self.pending[unit.index] = _Done() if handle is None else handle

    def drop_secondary(self, index: int | None = None) -> None:
        """Forget the secondary shards (of one unit, or all): the parameters changed."""
        if index is None:
            self.secondary.clear()
            self.secondary_lossy.clear()
        else:
            self.secondary.pop(index, None)
            self.secondary_lossy.discard(index)

    def secondary_bytes(self) -> int:
        """Bytes of secondary shards held now."""
        return sum(t.numel() * t.element_size() for t in self.secondary.values())

    # -- every path that changes parameters drops what it invalidates ------------------------------
    def gather_params(self) -> None:
        """As stage 3, after dropping the secondary shards (the step changed the shards)."""
        self.drop_secondary()
        super().gather_params()

    def write_owned(self, unit: Unit, values: torch.Tensor) -> None:
        """Set the owned shard; the unit's secondary shard is stale then."""
        self.drop_secondary(unit.index)
        super().write_owned(unit, values)

    def commit(self, unit: Unit) -> None:
        """As stage 3 (a full buffer changed in place): the unit's secondary shard is stale."""
        self.drop_secondary(unit.index)
        super().commit(unit)

    def reset(self) -> None:
        """As stage 3, and no secondary shard survives (e.g. a checkpoint is loaded next)."""
        super().reset()
        self.drop_secondary()

    def close(self, keep_parameters: bool = True) -> None:
        """As stage 3; the secondary shards go with the hooks."""
        try:
            super().close(keep_parameters)
        finally:
            self.drop_secondary()

    # -- memory ledger ---------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        """Stage 3's parameter storage plus the secondary shards."""
        return super().param_tensors() + list(self.secondary.values())

    def placed_param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Stage 3's placement; secondary shards are on the compute device."""
        placed = super().placed_param_tensors()
        placed.setdefault("device", []).extend(self.secondary.values())
        return placed


class _Done:
    """The handle of a gather that needed no communication (a group of one)."""

    def wait(self) -> None:
        """Nothing to wait for."""
