"""One parameter's whole fp32 master or optimizer state, from the shards that hold its pieces.

Each rank's master shard covers `[lo, hi)` of a unit's flat buffer; a parameter is a range of
that buffer, so its pieces lie on one or more ranks. `full_master(param)` puts this rank's piece
into a zero tensor of the parameter's size on the compute device and sums it over the ranks of
the optimizer's group (one all-reduce of the parameter's size, through the ledgered Comm). Every
rank of the group must call it for the same parameter (stage 0 needs no collective: every rank
holds all of it). A parameter no optimizer manages, or a frozen one, has no master: None.

Gradients, at stages 2 and 3 (where each rank's shard holds the averaged gradient as soon as the
backward returns; stages 0 and 1 average at the step): `local_grad(param)` is this rank's piece of
the parameter's gradient, a flat view into the shard (empty where the rank holds none of it), and
`set_local_grad` writes it, so a caller can change gradients between `backward` and `step`, which
then clips and steps what it finds. `full_grad` assembles the whole gradient as `full_master`
does. Under fp16 the values still carry the loss scale, which the step divides out.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dist.hostmem import host_region
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


def _grad_piece(param: nn.Parameter, caller: str):
    """(optimizer, unit, slot, this rank's piece of the gradient shard, where the piece starts in
    the parameter) of `param`, or None."""
    owner = owner_of(param)
    if owner is None or owner.unit.group_index < 0:
        return None
    opt, unit = owner.optimizer, owner.unit
    if opt.policy.stage < 2:
        raise ValueError(f"{caller}: the gradient shards hold averaged gradients at ZeRO stages 2 "
                         f"and 3; at stage {opt.policy.stage} they are averaged by step(). Read "
                         "param.grad after step's averaging instead, or use stage 2 or 3")
    slot = next(s for s in unit.slots if s.param is param)
    lo, hi = opt.policy.owned_bounds(unit)
    start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
    shard = opt.policy.grad_shard(unit)
    if start >= end:
        return opt, unit, slot, shard[:0], 0
    return opt, unit, slot, shard[start - lo:end - lo], start - slot.offset


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of `param`'s averaged gradient (a flat view), or None if unmanaged."""
    found = _grad_piece(param, "safe_get_local_grad")
    return None if found is None else found[3]


def set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's piece of `param`'s gradient with `value` (as `local_grad` gave it)."""
    found = _grad_piece(param, "safe_set_local_grad")
    if found is None:
        raise ValueError("safe_set_local_grad: no ZeRO optimizer manages this parameter (a frozen "
                         "one, or its engine was destroyed); only trained parameters have gradients")
    opt, _, _, piece, _ = found
    if getattr(opt.placement, "early", None) is not None:
        raise ValueError("safe_set_local_grad: this engine steps each unit during backward "
                         "(offload_optimizer with zeroshard_step_in_backward, no clipping, no loss "
                         "scaling), so the step has used the gradients already; set "
                         "offload_optimizer.zeroshard_step_in_backward to false to change them first")
    if value.numel() != piece.numel():
        raise ValueError(f"safe_set_local_grad: got {value.numel()} values for a piece of "
                         f"{piece.numel()} (pass what safe_get_local_grad returned, changed)")
    with host_region():
        piece.copy_(value.reshape(-1))


def full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The whole averaged gradient of `param` on every rank (collective), or None if unmanaged."""
    found = _grad_piece(param, "safe_get_full_grad")
    if found is None:
        return None
    opt, unit, slot, piece, at = found
    with host_region():
        out = torch.zeros(slot.numel, dtype=torch.float32, device=unit.compute_device)
        out[at:at + piece.numel()].copy_(piece)
    opt.comm.all_reduce(out)
    return out.view(slot.shape)
