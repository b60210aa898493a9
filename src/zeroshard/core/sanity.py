"""`zero_optimization.enable_sanity_checks` (DeepSpeed's): a stage-3 parameter under the check
that is modified in place inside `GatheredParameters(..., modifier_rank=None)` is an error on
every rank, instead of a change silently dropped when its unit is freed.

Which parameters are checked is recorded here, keyed weakly by the parameter (no attribute on
it), by `zeroshard.Init` and by `initialize()` at stage 3 when their config enables the check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ..dist import Comm, default_device

_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def check_in_place_writes(params) -> None:
    """Have `GatheredParameters(..., modifier_rank=None)` refuse in-place writes to `params`."""
    for param in params:
        _CHECKED[param] = True


def snapshot(params) -> list[tuple[torch.Tensor, int, int]]:
    """(parameter, data pointer, version) of the checked ones among `params`, taken while they
    are gathered: a write in place bumps the version, `.data = ...` moves the pointer."""
    return [(p, p.data.data_ptr(), p._version) for p in params if p in _CHECKED]


def refuse_in_place_writes(recorded: list[tuple[torch.Tensor, int, int]], comm: Comm) -> None:
    """Raise on every rank of `comm` if any rank wrote to a parameter of its `recorded` snapshot
    (a collective: every rank that took a snapshot must call it)."""
    if not recorded:
        return
    written = any(p.data.data_ptr() != ptr or p._version != version
                  for p, ptr, version in recorded)
    if comm.world_size > 1 and dist.is_initialized():
        flag = torch.tensor([int(written)], device=default_device())
        comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        written = bool(flag.item())
    if written:
        raise RuntimeError(
            "GatheredParameters: in-place modification of ZeRO-3 parameters with "
            "modifier_rank=None (zero_optimization.enable_sanity_checks is on); the change would "
            "be discarded when they are partitioned again. Pass modifier_rank=<the rank whose "
            "values to keep> to broadcast it to every rank, or leave the parameters unchanged.")
