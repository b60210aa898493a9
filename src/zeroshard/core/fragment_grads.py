"""One parameter's averaged gradient between `backward` and `step`, read and written by pieces.

What the step will use is what these read and write, so a caller can change gradients between
the engine's `backward` and `step` (which then clips and steps what it finds). Where that
gradient lives depends on the stage:

* stages 2-3: each rank's gradient shard holds the averaged gradient as soon as the backward
  returns; this rank's piece of a parameter (core/fragments.py's `Where`) is a range of it.
* stage 0: every rank holds the whole gradient; it is averaged (all-reduced) during the backward
  or by the step. Reading or writing it first completes that averaging (`reduce_gradients`: a
  second call, the step's, has nothing left to do), so the values are the average.
* stage 1: the full gradient buffers hold each rank's own (not yet averaged) gradient until the
  step reduce-scatters them. A full read averages a copy of the parameter's gradient (one
  all-reduce); a full write puts the value into every rank's buffer, so that the step's average
  of equal values gives it back (exactly in a power-of-two world, else within rounding). Once the
  step reduced the buffers they are no longer the gradient and both refuse.

Full getters and setters, and local ones at stage 1, are collective (every rank of the
optimizer's group calls them for the same parameter); a full setter takes the whole value on
every rank. Values are returned in fp32. Under fp16 they still carry the loss scale, which the
step divides out. A parameter without a master (frozen, unmanaged) reads None and refuses writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..dist.hostmem import host_region
from .fragments import Where, check_numel, locate, require


def _no_early(where: Where, caller: str) -> None:
    """Refuse while units are stepped during backward: the step has used the gradients already."""
    if getattr(where.opt.placement, "early", None) is not None:
        raise ValueError(f"{caller}: {where.name()}: this engine steps each unit during backward "
                         "(offload_optimizer with zeroshard_step_in_backward, no clipping, no "
                         "loss scaling), so the step has used the gradients already; set "
                         "offload_optimizer.zeroshard_step_in_backward to false to change them")


def _stage(where: Where) -> int:
    return where.opt.policy.stage


def _buffer_slot(where: Where) -> torch.Tensor:
    """Stages 0-1: the parameter's range of its unit's full gradient buffer (flat)."""
    slot = where.slot
    return where.opt.policy.grads.flats[where.unit.index][slot.offset:slot.offset + slot.numel]


def _stage1_open(where: Where, caller: str) -> None:
    """Stage 1: refuse once the step reduced the buffers (they no longer hold the gradient)."""
    if where.unit.index in getattr(where.opt.policy, "reduced", {}):
        raise ValueError(f"{caller}: {where.name()}: the optimizer step has reduced the "
                         "gradients already; read or write them between backward and step")


def _stage0_slots(where: Where) -> list[torch.Tensor]:
    """Stage 0, averaging completed: the gradient the step reads, and the buffer behind `.grad`
    where that is another tensor (a wider-dtype average)."""
    policy, slot = where.opt.policy, where.slot
    policy.reduce_gradients()
    read = policy.grad_shard(where.unit)[slot.offset:slot.offset + slot.numel]
    buffer = _buffer_slot(where)
    return [read] if read.data_ptr() == buffer.data_ptr() else [read, buffer]


def _shard_piece(where: Where) -> torch.Tensor:
    """Stages 2-3: this rank's piece of the gradient shard (flat view; may be empty)."""
    shard = where.opt.policy.grad_shard(where.unit)
    return shard[where.start - where.lo:where.end - where.lo]


def _full(where: Where, caller: str) -> torch.Tensor:
    opt, slot = where.opt, where.slot
    device = where.unit.compute_device
    stage = _stage(where)
    with host_region():
        if stage == 0:
            return _stage0_slots(where)[0].to(device=device, dtype=torch.float32,
                                              copy=True).view(slot.shape)
        if stage == 1:
            _stage1_open(where, caller)
            out = _buffer_slot(where).to(device=device, dtype=torch.float32, copy=True)
            opt.comm.all_reduce(out)
            return out.div_(opt.comm.world_size).view(slot.shape)
        out = torch.zeros(slot.numel, dtype=torch.float32, device=device)
        out[where.at:where.at + where.numel].copy_(_shard_piece(where))
    opt.comm.all_reduce(out)
    return out.view(slot.shape)


def _set_full(where: Where, value: torch.Tensor, caller: str) -> None:
    _no_early(where, caller)
    check_numel(where, value, where.slot.numel, caller, "the whole parameter")
    flat = value.detach().reshape(-1)
    with host_region(), torch.no_grad():
        stage = _stage(where)
        if stage == 0:
            for target in _stage0_slots(where):
                target.copy_(flat)
        elif stage == 1:
            _stage1_open(where, caller)
            _buffer_slot(where).copy_(flat)
        else:
            _shard_piece(where).copy_(flat[where.at:where.at + where.numel])


def full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The whole averaged gradient of `param` in fp32 on every rank (collective), or None."""
    where = locate(param)
    return None if where is None else _full(where, "safe_get_full_grad")


def set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make `value` (the whole gradient, the same on every rank) what the step uses for `param`."""
    _set_full(require(param, "safe_set_full_grad"), value, "safe_set_full_grad")


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of `param`'s averaged gradient, or None: a flat view into the gradient
    shard at stages 2-3, an fp32 copy at stages 0-1 (collective at stage 1)."""
    where = locate(param)
    if where is None:
        return None
    if _stage(where) >= 2:
        return _shard_piece(where)
    whole = _full(where, "safe_get_local_grad").reshape(-1)
    return whole[where.at:where.at + where.numel].clone()


def set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's piece of `param`'s gradient with `value` (as `local_grad` gave it);
    at stage 1 every rank calls it (the pieces are joined into the whole gradient)."""
    caller = "safe_set_local_grad"
    where = require(param, caller)
    _no_early(where, caller)
    check_numel(where, value, where.numel, caller, "a piece")
    stage = _stage(where)
    if stage >= 2:
        with host_region(), torch.no_grad():
            _shard_piece(where).copy_(value.detach().reshape(-1))
        return
    if stage == 0:  # the piece is the whole parameter
        _set_full(where, value, caller)
        return
    whole = torch.zeros(where.slot.numel, dtype=torch.float32, device=where.unit.compute_device)
    whole[where.at:where.at + where.numel].copy_(value.detach().reshape(-1))
    where.opt.comm.all_reduce(whole)
    _set_full(where, whole, caller)


def update_full_grads(params: Iterable[nn.Parameter],
                      update: Callable[[torch.Tensor, nn.Parameter], torch.Tensor]) -> None:
    """For each parameter: `update(its whole averaged gradient, the parameter)` becomes its
    gradient (collective; every rank passes the same parameters in the same order). Frozen
    parameters are skipped; one no engine manages has its `.grad` (if any) replaced."""
    for param in params:
        where = locate(param)
        if where is None:
            if param.requires_grad and param.grad is not None:
                with torch.no_grad():
                    param.grad.copy_(update(param.grad, param))
            continue
        _set_full(where, update(_full(where, "safe_update_full_grad_vectorized"), param),
                  "safe_update_full_grad_vectorized")
