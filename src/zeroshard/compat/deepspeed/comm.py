"""`zeroshard.comm`: DeepSpeed's `deepspeed.comm` names (what `deepspeed.comm` answers with under
`zeroshard run`), plus the public names of `zeroshard.dist` for scripts that import them from
here. zeroshard's own code imports `zeroshard.dist`.

The collectives are torch.distributed's, called with DeepSpeed's argument names (its `prof`,
`log_name` and `debug` keywords are accepted and ignored). Before any process group exists the
process counts as a world of one, as a plain `python train.py` does under zeroshard: ranks and
sizes answer 0 and 1 and a collective leaves its result as that single rank would have it, so a
script that calls them before (or without) `init_distributed` still runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...dist.comm import Comm, HostLayout, default_device, wait_all  # noqa: F401 (public)
from ...dist.hostpolicy import HostMemoryError, strict_host  # noqa: F401 (public)
from ...dist.process_group import env_int, init_distributed, leave_cleanly_at_exit  # noqa: F401

ReduceOp = dist.ReduceOp
# torch >= 2.13's names for these (its *_tensor names warn that they are deprecated there).
_ALL_GATHER_INTO_TENSOR = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_TENSOR = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
#: DeepSpeed's name for "the default group".
WORLD = None


def is_available() -> bool:
    """Whether torch.distributed is built into this torch."""
    return dist.is_available()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def destroy_process_group(group=None) -> None:
    """Destroy `group` (default: the default group and every other); no-op without one."""
    if is_initialized():
        dist.destroy_process_group(group)


def new_group(ranks):
    """A process group over the global `ranks` (collective: every rank must call it)."""
    return dist.new_group(ranks)


def get_world_group():
    """The default (world) process group."""
    return dist.group.WORLD


def get_backend(group=None) -> str:
    """The backend of `group` ("gloo", "nccl"); the one init_distributed would pick before any."""
    if is_initialized():
        return dist.get_backend(group)
    return "nccl" if torch.cuda.is_available() else "gloo"


def get_rank(group=None) -> int:
    """This process's rank in `group` (0 before the process group exists)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """Number of ranks in `group` (1 before the process group exists)."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """Rank within this node, from LOCAL_RANK (0 when unset)."""
    return env_int("LOCAL_RANK", "SLURM_LOCALID") or 0


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """The global rank of rank `group_rank` of `group`."""
    if not is_initialized() or group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    """The global ranks of `group`, in group order."""
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def barrier(group=None, async_op: bool = False, device_ids=None, **_profiling):
    """Wait for every rank of `group` (no-op in a world of one without a process group)."""
    if is_initialized():
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
               **_profiling):
    """All-reduce `tensor` in place over `group` (default: every rank)."""
    if not is_initialized():
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, **_profiling):
    """DeepSpeed's low-latency all-reduce for inference: here the plain one, synchronous."""
    return all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False,
           **_profiling):
    """Reduce `tensor` onto rank `dst`."""
    if not is_initialized():
        return None
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, **_profiling):
    """Copy rank `src`'s `tensor` into every rank's."""
    if not is_initialized():
        return None
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list: list, src: int, group=None, device=None, **_profiling):
    """Replace `object_list`'s items on every rank with rank `src`'s (picklable objects)."""
    if is_initialized():
        dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False,
               **_profiling):
    """Fill `tensor_list[r]` with rank r's `tensor`."""
    if not is_initialized():
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj, group=None, **_profiling) -> None:
    """Fill `object_list[r]` with rank r's `obj` (picklable)."""
    if not is_initialized():
        object_list[0] = obj
        return
    dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False, **_profiling):
    """Every rank's `tensor` laid end to end (in rank order) in `output_tensor`."""
    if not is_initialized():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return _ALL_GATHER_INTO_TENSOR(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False, **_profiling):
    """Rank r's `output_tensor` is the reduction of slice r of every rank's `tensor`."""
    if not is_initialized():
        output_tensor.copy_(tensor.reshape(output_tensor.shape))
        return None
    return _REDUCE_SCATTER_TENSOR(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False, **_profiling):
    """Rank r sends slice s of `tensor` to rank s, receiving into slice r of `output`."""
    if not is_initialized():
        output.copy_(tensor)
        return None
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    """Whether torch has all_gather_into_tensor (always, for the torch zeroshard needs)."""
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    """Whether torch has reduce_scatter_tensor (always, for the torch zeroshard needs)."""
    return hasattr(dist, "reduce_scatter_tensor")


__all__ = ["Comm", "HostLayout", "HostMemoryError", "ReduceOp", "WORLD", "all_gather",
           "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all_single",
           "barrier", "broadcast", "broadcast_object_list", "default_device",
           "destroy_process_group", "env_int", "get_all_ranks_from_group", "get_backend",
           "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size",
           "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "inference_all_reduce",
           "init_distributed", "is_available", "is_initialized", "leave_cleanly_at_exit",
           "new_group", "reduce", "reduce_scatter_tensor", "strict_host", "wait_all"]
