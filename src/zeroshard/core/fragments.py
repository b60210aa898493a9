"""One parameter's whole fp32 master or optimizer state, from the shards that hold its pieces.

Each rank's master shard covers `[lo, hi)` of a unit's flat buffer; a parameter is a range of
that buffer, so its pieces lie on one or more ranks. `full_master(param)` puts this rank's piece
into a zero tensor of the parameter's size on the compute device and sums it over the ranks of
the optimizer's group (one all-reduce of the parameter's size, through the ledgered Comm). Every
rank of the group must call it for the same parameter (stage 0 needs no collective: every rank
holds all of it). A parameter no optimizer manages, or a frozen one, has no master: None.
"""

from __future__ import annotations

import torch
from torch import nn

from .hostmem import host_region
from .owners import owner_of


def _piece(param: nn.Parameter, pick) -> torch.Tensor | None:
    owner = owner_of(param)
    if owner is None or owner.unit.group_index < 0:
        return None
    opt, unit = owner.optimizer, owner.unit
    slot = next(s for s in unit.slots if s.param is param)
    lo, hi = opt.policy.owned_bounds(unit)
    with host_region():
        master, state = opt.placement.tensors(unit)
        source = pick(master, state)
        if source is None:
            return None
        out = torch.zeros(slot.numel, dtype=torch.float32, device=unit.compute_device)
        start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if start < end:
            out[start - slot.offset:end - slot.offset].copy_(source[start - lo:end - lo])
    if opt.policy.shards_optimizer:
        opt.comm.all_reduce(out)
    return out.view(slot.shape)


def full_master(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of `param` on every rank (collective), or None if it has none."""
    return _piece(param, lambda master, state: master)


def full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """The whole optimizer state `key` (e.g. Adam's "exp_avg") of `param` (collective), or None."""
    def pick(master, state):
        value = state.get(key)
        if not torch.is_tensor(value) or value.shape != master.shape:
            return None
        return value
    return _piece(param, pick)
