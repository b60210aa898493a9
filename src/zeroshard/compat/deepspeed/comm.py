"""`zeroshard.comm`: DeepSpeed's `deepspeed.comm` names (what `deepspeed.comm` answers with under
`zeroshard run`), on the default process group, plus the public names of `zeroshard.dist` for
scripts that import them from here. zeroshard's own code imports `zeroshard.dist`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...dist.comm import Comm, HostLayout, default_device, wait_all  # noqa: F401 (public)
from ...dist.hostpolicy import HostMemoryError, strict_host  # noqa: F401 (public)
from ...dist.process_group import env_int, init_distributed, leave_cleanly_at_exit  # noqa: F401


def get_rank() -> int:
    """This process's rank (0 before the process group exists)."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """Number of ranks (1 before the process group exists)."""
    return dist.get_world_size() if is_initialized() else 1


def get_local_rank() -> int:
    """Rank within this node, from LOCAL_RANK (0 when unset)."""
    return env_int("LOCAL_RANK", "SLURM_LOCALID") or 0


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank (no-op in a world of one without a process group)."""
    if is_initialized():
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduce `tensor` in place over `group` (default: every rank)."""
    if not is_initialized():
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def destroy_process_group(group=None) -> None:
    """Tear down `group` (default: the world's process group); no-op when none exists."""
    if is_initialized():
        dist.destroy_process_group(group)


ReduceOp = dist.ReduceOp

__all__ = ["Comm", "HostLayout", "HostMemoryError", "ReduceOp", "all_reduce", "barrier",
           "default_device", "destroy_process_group", "env_int", "get_local_rank", "get_rank", "get_world_size",
           "init_distributed", "is_initialized", "leave_cleanly_at_exit", "strict_host", "wait_all"]
