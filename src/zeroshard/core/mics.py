"""MiCS (`mics_shard_size` = S): stage 3 sharded over groups of S ranks, replicated across groups:
stage 3 over the shard group's Comm with the `ReplicaReduce` strategy.

Parameters, gradients and optimizer state are sharded over a *shard group* of S consecutive
ranks only (typically the ranks of one host, or of a few), so the parameter all-gathers and the
gradient reduce-scatters never leave the group; the N/S groups are replicas of each other. The
optimizer works over the shard group's Comm exactly as stage 3 works over the world's (units are
padded for S shards, rank r owns shard r mod S), and the engine keeps the world's Comm for data,
batch size and checkpoints. The two groups are the builder's `World`'s (`build.py`,
`dist/world.py`): made once, counted in the world's ledger, watched with its deadline.

Communication plan, per micro-step (shard group: S consecutive ranks; replica group: the N/S
ranks with the same position in their shard groups):
  1. forward and backward: as stage 3 inside the shard group: all-gathers of Psi (S-1)/S per
     gather and a reduce-scatter of Psi (S-1)/S, the gradient shards averaged over the group.
  2. accumulation boundary: each gradient shard (Psi / S elements) is all-reduced across the
     replica group and divided by N/S, so every replica steps the same average over all N ranks.
     Ring cost: 2 (R-1)/R x Psi / S, R = N/S.
  3. step: each rank steps its shard, as stage 3; replicas compute the same update.
Before the masters are taken, the shards of group 0 (rank 0's weights, as everywhere in
zeroshard) are broadcast across each replica group (`sync_replicas`), so every replica starts equal.
"""

from __future__ import annotations

import torch

from ..dist import Comm
from .layout import Unit
from .strategies import ReduceHandle, ReduceStrategy


class ReplicaReduce(ReduceStrategy):
    """MiCS: the wrapped reduction inside the shard group, then at the accumulation boundary the
    replica all-reduce of each gradient shard, divided by the number of replicas."""

    def __init__(self, inner: ReduceStrategy, replicas: Comm):
        """`replicas`: this rank's replica group (the ranks holding the same shards)."""
        self.inner = inner
        self.replicas = replicas

    def replica_position(self) -> int:
        """This rank's place in its replica group."""
        return self.replicas.rank

    def start(self, buffer: torch.Tensor, unit: Unit) -> ReduceHandle:
        """The shard group's reduction (the wrapped one)."""
        return self.inner.start(buffer, unit)

    def finish_boundary(self, units: list[Unit], grad_shards: dict[int, torch.Tensor]) -> None:
        """Average the gradient shards over the replica groups."""
        self.inner.finish_boundary(units, grad_shards)
        if self.replicas.world_size == 1:
            return
        for unit in units:
            shard = grad_shards[unit.index]
            self.replicas.all_reduce(shard, unit=unit)
            shard.mul_(1.0 / self.replicas.world_size)

    def close(self) -> None:
        """The wrapped reduction's groups."""
        self.inner.close()


def sync_replicas(units, persistent: set[int], replicas: Comm) -> None:
    """Give every replica shard group 0's values (rank 0's weights), before masters are taken."""
    for unit in units:
        replicas.broadcast(unit.flat if unit.index in persistent else unit.shard, src=0, unit=unit)


def replica_position(policy) -> int:
    """Which replica of the shard group this rank is in (0: the first, and always without MiCS):
    the policy's answer (`StagePolicy.replica_position`)."""
    return policy.replica_position()
