"""Which host each global rank runs on (torchrun's LOCAL_WORLD_SIZE, or Slurm's tasks per
node): the comm ledger's intra-/inter-host split and the ZeRO++ host groups read it; and the
global ranks of a process group."""

from __future__ import annotations

import os
import warnings

import torch.distributed as dist

from .process_group import env_int


class HostLayout:
    """Which host each global rank runs on: P consecutive ranks per host, in rank order."""

    def __init__(self, ranks_per_host: int):
        self.ranks_per_host = max(1, int(ranks_per_host))

    @classmethod
    def from_env(cls, world_size: int) -> "HostLayout":
        """The layout torchrun (LOCAL_WORLD_SIZE) or Slurm (SLURM_NTASKS_PER_NODE) describes.

        One host when neither says (a plain process, or ranks spawned by hand on one machine).
        """
        per_host = env_int("LOCAL_WORLD_SIZE")
        if per_host is None:
            slurm = os.environ.get("SLURM_NTASKS_PER_NODE", "")
            per_host = int(slurm) if slurm.isdigit() else None  # "2(x3)" forms: not uniform
        if per_host is None or per_host <= 0:
            return cls(world_size)
        group_rank, rank = env_int("GROUP_RANK"), env_int("RANK")
        if world_size % per_host or (group_rank is not None and rank is not None
                                     and group_rank != rank // per_host):
            # Hosts of different sizes: the ranks of host h are not h*P .. h*P+P-1.
            warnings.warn(f"comm ledger: hosts do not all run LOCAL_WORLD_SIZE={per_host} ranks; "
                          "its intra-/inter-host split assumes they do", RuntimeWarning,
                          stacklevel=2)
        return cls(per_host)

    def host(self, rank: int) -> int:
        """The host of global rank `rank`."""
        return rank // self.ranks_per_host

    def crossing_share(self, ranks: list[int]) -> float:
        """The share of a ring's hops over `ranks` (global ranks, ring order) that cross hosts."""
        n = len(ranks)
        if n < 2:
            return 0.0
        crossing = sum(self.host(ranks[i]) != self.host(ranks[(i + 1) % n]) for i in range(n))
        return crossing / n


def group_ranks(group) -> list[int]:
    """The global ranks of process group `group` (None: the default group), in group order."""
    size = dist.get_world_size(group)
    return [dist.get_global_rank(group, r) for r in range(size)] if group is not None \
        else list(range(size))
