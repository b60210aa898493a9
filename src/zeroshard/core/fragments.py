"""One parameter's fp32 master and optimizer state, read and written from the shards that hold it.

Each rank's master shard covers `[lo, hi)` of a unit's flat buffer; a parameter is a range of
that buffer, so its pieces lie on one or more ranks. This rank's *piece* of a parameter is where
the parameter's range meets `[lo, hi)` (flat, possibly empty; at stage 0 the whole parameter,
since every rank steps all of it).

* Full getters (`full_master`, `full_optimizer_state`) put this rank's piece into a zero tensor of
  the parameter's size on the compute device and sum it over the optimizer's group (one
  all-reduce of the parameter's size; none at stage 0): every rank of the group calls them for
  the same parameter.
* Full setters (`set_full_master`, `set_full_optimizer_state`) take the whole value on every
  rank; each rank writes its own piece and no rank communicates.
* Local getters and setters (`local_master`, `set_local_master`, `local_optimizer_state`,
  `set_local_optimizer_state`) read or write this rank's piece only.

Writing a master keeps the compute-dtype parameter equal to it, under every placement of masters
and optimizer state (device, CPU, NVMe swap files): the owned compute slice is rewritten from the
master (`policy.write_owned`, which also reaches stage 3's shard wherever it is placed), and a
unit whole on this rank (stages 0-2; stage 3's persistent or gathered units) gets the value in
its full buffer too: from the value itself for a full setter; for a local setter by one
all-gather of the unit over the group (so `set_local_master` is collective wherever the
optimizer shards a unit that is whole on every rank).

A parameter no optimizer manages, or a frozen one, has no master: getters return None, setters
raise ValueError. Gradients are core/fragment_grads.py's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..dist.hostmem import host_region
from .owners import owner_of


class Where(NamedTuple):
    """Where a parameter lies: its optimizer, unit and slot, this rank's owned `[lo, hi)` of the
    unit and its piece `[start, end)` of the parameter there (unit coordinates; empty if
    start >= end)."""

    opt: object
    unit: object
    slot: object
    lo: int
    hi: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        """Elements of this rank's piece."""
        return max(0, self.end - self.start)

    @property
    def at(self) -> int:
        """Where this rank's piece starts in the (flattened) parameter."""
        return min(self.start, self.end) - self.slot.offset

    def name(self) -> str:
        """The parameter's name and shape, for messages."""
        return f"parameter {self.slot.name!r} {tuple(self.slot.shape)}"


def locate(param: nn.Parameter) -> Where | None:
    """Where `param` lies, or None if no live ZeRO optimizer trains it (unmanaged or frozen)."""
    owner = owner_of(param)
    if owner is None or owner.unit.group_index < 0:
        return None
    opt, unit = owner.optimizer, owner.unit
    slot = next(s for s in unit.slots if s.param is param)
    lo, hi = opt.policy.owned_bounds(unit)
    start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
    return Where(opt, unit, slot, lo, hi, start, max(start, end))


def require(param: nn.Parameter, caller: str) -> Where:
    """`locate(param)`, or ValueError naming the parameter when nothing trains it."""
    where = locate(param)
    if where is None:
        frozen = "requires_grad=False" if not param.requires_grad else "not given to the engine"
        raise ValueError(
            f"{caller}: the parameter of shape {tuple(param.shape)} ({frozen}, or its engine was "
            "destroyed) has no fp32 master, optimizer state or gradient; only parameters a ZeRO "
            "optimizer trains have them")
    return where


def check_numel(where: Where, value: torch.Tensor, expected: int, caller: str, what: str) -> None:
    """ValueError naming the parameter when `value` does not have `expected` elements."""
    if not torch.is_tensor(value):
        raise TypeError(f"{caller}: {where.name()}: expected a tensor, got {type(value).__name__}")
    if value.numel() != expected:
        raise ValueError(f"{caller}: {where.name()}: got {value.numel()} values for {what} of "
                         f"{expected} elements (a value of shape {tuple(value.shape)})")


def _target(where: Where, master: torch.Tensor, state: dict, key: str | None, caller: str):
    """The unit's master, or its optimizer state `key` (a tensor shaped as the master)."""
    if key is None:
        return master
    value = state.get(key)
    if torch.is_tensor(value) and value.shape == master.shape:
        return value
    known = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape)
    if not known:
        raise ValueError(f"{caller}: {where.name()} has no optimizer state yet (the first "
                         f"optimizer step creates it); {key!r} cannot be used before then")
    raise ValueError(f"{caller}: {where.name()}: no per-element optimizer state {key!r}; this "
                     f"optimizer keeps {known}")


def _read(param: nn.Parameter, key: str | None, full: bool) -> torch.Tensor | None:
    where = locate(param)
    if where is None:
        return None
    opt, unit, slot = where.opt, where.unit, where.slot
    with host_region():
        master, state = opt.placement.tensors(unit)
        source = master if key is None else state.get(key)
        if not (torch.is_tensor(source) and source.shape == master.shape):
            return None  # as DeepSpeed: a getter of a state not made (yet) gives nothing
        piece = source[where.start - where.lo:where.end - where.lo]
        if not full:
            return piece.to(device=unit.compute_device, dtype=torch.float32, copy=True)
        out = torch.zeros(slot.numel, dtype=torch.float32, device=unit.compute_device)
        out[where.at:where.at + where.numel].copy_(piece)
    if opt.policy.shards_optimizer:
        opt.comm.all_reduce(out)
    return out.view(slot.shape)


def _write(param: nn.Parameter, value: torch.Tensor, key: str | None, caller: str,
           full: bool) -> None:
    where = require(param, caller)
    opt, unit, slot = where.opt, where.unit, where.slot
    if full:
        check_numel(where, value, slot.numel, caller, "the whole parameter")
        flat = value.detach().reshape(-1)
        piece = flat[where.at:where.at + where.numel]
    else:
        check_numel(where, value, where.numel, caller, "a piece")
        flat, piece = None, value.detach().reshape(-1)
    with host_region(), torch.no_grad():
        master, state = opt.placement.tensors(unit)
        target = _target(where, master, state, key, caller)
        target[where.start - where.lo:where.end - where.lo].copy_(piece)
        opt.placement.flush()
        if key is None:
            _follow_master(where, master, flat)


def _follow_master(where: Where, master: torch.Tensor, whole: torch.Tensor | None) -> None:
    """Make the compute-dtype parameter equal to its just written master (see the docstring):
    `whole` is the full value every rank was given (a full setter), None for a local one."""
    opt, unit, slot = where.opt, where.unit, where.slot
    policy = opt.policy
    policy.write_owned(unit, master)
    if not unit.is_gathered:
        return  # a stage-3 shard: the next gather reads the rewritten shard
    if whole is not None:
        unit.flat[slot.offset:slot.offset + slot.numel].copy_(whole)
        return
    if not policy.shards_optimizer:
        return  # stage 0: the owned slice is the whole buffer
    own = unit.flat[where.lo:where.hi]
    current = policy.read_owned(unit)
    if current.data_ptr() != own.data_ptr():
        own.copy_(current)
    opt.comm.all_gather(unit.flat, own, unit=unit)


def full_master(param: nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master of `param` on every rank (collective), or None if it has none."""
    return _read(param, None, full=True)


def full_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """The whole optimizer state `key` (e.g. Adam's "exp_avg") of `param` (collective), or None
    (no master, or no such per-element state yet)."""
    return _read(param, key, full=True)


def local_master(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of `param`'s fp32 master (flat, a copy; may be empty), or None."""
    return _read(param, None, full=False)


def local_optimizer_state(param: nn.Parameter, key: str) -> torch.Tensor | None:
    """This rank's piece of `param`'s optimizer state `key` (flat, a copy), or None."""
    return _read(param, key, full=False)


def set_full_master(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master and compute-dtype values to `value` (the whole parameter, the
    same on every rank; each rank writes its own piece, no communication)."""
    _write(param, value, None, "safe_set_full_fp32_param", full=True)


def set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Set `param`'s optimizer state `key` to `value` (the whole parameter, on every rank)."""
    _write(param, value, key, "safe_set_full_optimizer_state", full=True)


def set_local_master(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's piece of `param`'s fp32 master (and its compute-dtype values) to `value`;
    collective where a sharded unit is whole on every rank (stages 1-2, stage-3 persistent)."""
    _write(param, value, None, "safe_set_local_fp32_param", full=False)


def set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Set this rank's piece of `param`'s optimizer state `key` to `value`."""
    _write(param, value, key, "safe_set_local_optimizer_state", full=False)
