"""The one place process groups below the world are made: hpZ's host groups, MiCS's shard and
replica groups, qgZ's intra- and inter-host groups are each a partition of a Comm's ranks.

`split` creates every part's group on every rank in the same order (torch.distributed's rule:
`new_group` is collective over the whole world) and returns this rank's part as a Comm made with
the parent's ledger (each collective keeps its own group's intra-/inter-host split), the parent's
step counter and a watchdog with the parent's deadline, like every other collective of the step.
A `World` (`world.py`) keeps the parts it was asked for, so each is made once.
"""

from __future__ import annotations

import torch.distributed as dist

from .comm import Comm


def split(comm: Comm, parts: list[list[int]]) -> Comm:
    """This rank's Comm over its part of `parts` (positions in `comm`, every rank in one part)."""
    mine = None
    for part in parts:
        group = dist.new_group([comm._ranks[r] for r in part])
        if comm.rank in part:
            mine = group
    if mine is None:
        raise ValueError(f"rank {comm.rank} is in none of the groups {parts}")
    watch = comm.watch.for_group(mine) if comm.watch is not None else None
    return Comm(mine, ledger=comm.ledger, watch=watch, steps=comm.steps)


def blocks(world: int, size: int) -> list[list[int]]:
    """Consecutive groups of `size` ranks (the ranks of one host, a MiCS shard group)."""
    return [list(range(start, start + size)) for start in range(0, world, size)]


def strided(world: int, size: int) -> list[list[int]]:
    """The ranks at the same position of each block of `size` (one per host, a MiCS replica)."""
    return [list(range(position, world, size)) for position in range(size)]
