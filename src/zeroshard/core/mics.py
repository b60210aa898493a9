"""MiCS (`mics_shard_size` = S): stage 3 sharded over groups of S ranks, replicated across groups.

Parameters, gradients and optimizer state are sharded over a *shard group* of S consecutive
ranks only (typically the ranks of one host, or of a few), so the parameter all-gathers and the
gradient reduce-scatters never leave the group; the N/S groups are replicas of each other. The
optimizer works over the shard group's Comm exactly as stage 3 works over the world's (units are
padded for S shards, rank r owns shard r mod S), and the engine keeps the world's Comm for data,
batch size and checkpoints.

Communication plan, per micro-step (shard group: S consecutive ranks; replica group: the N/S
ranks with the same position in their shard groups):
  1. forward and backward: as stage 3 inside the shard group: all-gathers of Psi (S-1)/S per
     gather and a reduce-scatter of Psi (S-1)/S, the gradient shards averaged over the group.
  2. accumulation boundary: each gradient shard (Psi / S elements) is all-reduced across the
     replica group and divided by N/S, so every replica steps the same average over all N ranks.
     Ring cost: 2 (R-1)/R x Psi / S, R = N/S.
  3. step: each rank steps its shard, as stage 3; replicas compute the same update.
At construction the shards of group 0 (rank 0's weights, as everywhere in zeroshard) are
broadcast across each replica group, so every replica starts equal.
"""

from __future__ import annotations

from ..dist import Comm
from .groups import blocks, split, strided
from .stage3 import Stage3


def mics_comms(comm: Comm, size: int) -> tuple[Comm, Comm]:
    """(shard group, replica group) Comms of this rank, every group created on every rank in the
    same order; both count in `comm`'s ledger and get `comm`'s desync deadline."""
    return split(comm, blocks(comm.world_size, size)), \
        split(comm, strided(comm.world_size, size))


class Stage3MiCS(Stage3):
    """Stage 3 over the shard group (`comm`), plus the replica all-reduce of gradient shards."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replicas: Comm = self.options.mics_replicas

    def reduce_gradients(self) -> None:
        """As stage 3, then average the gradient shards over the replica groups."""
        super().reduce_gradients()
        if self.replicas.world_size == 1:
            return
        for unit in self.units:
            shard = self.grad_shards[unit.index]
            self.replicas.all_reduce(shard, unit=unit)
            shard.mul_(1.0 / self.replicas.world_size)


def sync_replicas(units, persistent: set[int], replicas: Comm) -> None:
    """Give every replica shard group 0's values (rank 0's weights), before masters are taken."""
    for unit in units:
        replicas.broadcast(unit.flat if unit.index in persistent else unit.shard, src=0, unit=unit)


def replica_targets(opt) -> tuple[int, int] | None:
    """For checkpoints: (shard world, shard rank) when the optimizer shards over MiCS groups."""
    if isinstance(getattr(opt, "policy", None), Stage3MiCS):
        return opt.comm.world_size, opt.comm.rank
    return None

