"""`GatheredParameters`: DeepSpeed's context in which listed parameters are whole on every rank.

At stage 3 (and for a model built under `zeroshard.Init` but not yet wrapped) the units holding
the listed parameters are gathered on entry and kept gathered (pinned) until exit, so forward
hooks inside the context do not free them. At stages 0-2 every rank already holds whole
parameters and nothing is gathered.

On exit, with `modifier_rank` set, that rank's changes (in place, or a `.data` replaced by a tensor
of the same shape) are broadcast to every rank, copied into this rank's shard (stage 3) and into
the fp32 master shards, so the next optimizer step does not overwrite them. Without
`modifier_rank`, changes to sharded parameters are discarded when the unit is freed (stage 3), and
stay local to each rank at stages 0-2, as in DeepSpeed; with `zero_optimization.enable_sanity_checks`
such an in-place change to a stage-3 parameter is an error on every rank instead (core/sanity.py).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..dist import Comm, default_device
from ..dist.world import World
from .init_units import gather_init_units
from .layout import INIT_ATTR, plain_name
from .owners import owner_of
from .sanity import refuse_in_place_writes, snapshot


def _as_list(params) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, Iterable):
        # None entries are skipped (transformers passes a bias that a layer does not have).
        return [p for p in params if p is not None]
    raise TypeError(f"GatheredParameters expects a parameter, a list or a generator of them, "
                    f"got {type(params).__name__}")


class GatheredParameters:
    """Context in which `params` are whole on every rank; `modifier_rank`'s changes are kept."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)

    def __enter__(self):
        if not self.enabled:
            return self
        self._pinned = {}  # id(policy) -> (policy, unit indices)
        for param in self.params:
            owner = owner_of(param)
            policy = owner.optimizer.policy if owner is not None else None
            if policy is not None and hasattr(policy, "pin"):  # stage 3 gathers and frees units
                self._pinned.setdefault(id(policy), (policy, set()))[1].add(owner.unit.index)
        for policy, indices in self._pinned.values():
            policy.pin(indices)
        self._init_units = gather_init_units(self.params)
        # Taken once gathered: the gather itself re-points `.data`.
        self._snapshot = snapshot(self.params) if self.modifier_rank is None else []
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._publish()
            elif self._snapshot and exc_type is None:
                refuse_in_place_writes(self._snapshot, _comm_of(self._snapshot[0][0]))
        finally:
            for policy, indices in self._pinned.values():
                policy.unpin(indices)
            for unit in self._init_units:
                unit.release(detach=True)

    def _publish(self) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not 0 <= self.modifier_rank < world:
            raise ValueError(f"GatheredParameters: modifier_rank {self.modifier_rank} is not a rank "
                             f"of this world of {world}")
        device = default_device()
        rank = dist.get_rank() if world > 1 else 0
        with torch.no_grad():
            wrong = _reseat(self.params, keep=rank == self.modifier_rank)
            for param in self.params if world > 1 else ():
                data = param.data
                if data.device == device:
                    _comm_of(param).broadcast(data, src=self.modifier_rank)
                else:  # a parameter zeroshard does not manage, built on the CPU: NCCL needs device
                    moved = data.to(device)
                    _comm_of(param).broadcast(moved, src=self.modifier_rank)
                    data.copy_(moved)
            for unit in self._init_units:
                unit.shard.copy_(unit.flat[slice(*unit.shard_bounds(rank))])
            _refresh_masters(self.params)
        if wrong:
            raise ValueError(
                f"GatheredParameters: on modifier rank {rank} parameters were given data of "
                f"another shape inside the context ({'; '.join(wrong[:3])}); their values were "
                "left unchanged on every rank. Write values of the laid-out shape "
                "(param.data.copy_(...)), or change the model's shapes before zeroshard.Init / "
                "initialize()")


def _reseat(params: list[nn.Parameter], keep: bool) -> list[str]:
    """Point parameters whose `.data` was replaced inside the context (`p.data = new`, not a
    write in place) back at their unit's buffer, which is what is broadcast, sharded and trained;
    with `keep` (the modifier rank) the new values are copied into it first. Returns the names of
    replacements of the wrong shape, left out: raising here, before the broadcast the other ranks
    are already in, would leave them waiting."""
    wrong = []
    for param in params:
        unit = _unit_of(param)
        if unit is None or not unit.is_gathered:
            continue
        slot = next(s for s in unit.slots if s.param is param)
        view = unit.flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
        if param.data.data_ptr() == view.data_ptr() and param.data.shape == view.shape:
            continue
        if keep and param.data.shape == slot.shape:
            view.copy_(param.data)
        elif keep:
            wrong.append(f"{slot.name}: {tuple(param.data.shape)} for {tuple(slot.shape)}")
        param.data = view
    return wrong


def _unit_of(param: nn.Parameter):
    """The engine unit (or construction-time unit) holding `param`, or None."""
    owner = owner_of(param)
    if owner is not None:
        return owner.unit
    owner = getattr(param, INIT_ATTR, None)
    return owner[0] if owner is not None else None


def _comm_of(param: nn.Parameter) -> Comm:
    """The engine's Comm for a managed parameter (so its comm ledger counts), Init's for one
    partitioned at construction, else the current World's."""
    owner = owner_of(param)
    if owner is not None:
        return owner.world_comm  # under MiCS the optimizer's Comm is only its shard group
    owner = getattr(param, INIT_ATTR, None)
    return owner[1] if owner is not None else World.current().comm


def _refresh_masters(params: list[nn.Parameter]) -> None:
    """Copy changed parameters into the shards and fp32 masters of the units that hold them."""
    for param in params:
        owner = owner_of(param)
        if owner is not None:
            owner.optimizer.refresh_master(owner.unit, param)


def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict:
    """`module.state_dict()` with whole tensors, gathered one unit at a time (stage 3).

    Every rank must call it (the gathers are collective). With `rank0_only`, ranks other than 0
    return an empty dict and keep nothing; rank 0 holds the result plus one unit at a time.
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    tensors = module.state_dict(keep_vars=True)
    copies: dict[int, torch.Tensor] = {}
    batches: dict[int, list[nn.Parameter]] = {}  # one gather per unit, in registration order
    for param in module.parameters():
        batches.setdefault(id(_unit_of(param) or param), []).append(param)
    for params in batches.values():
        with GatheredParameters(params):
            if keep:
                for param in params:
                    copies[id(param)] = param.detach().clone()
    if not keep:
        return {}
    # Plain names, also for a model wrapped by torch.compile (`_orig_mod.` dropped).
    return {plain_name(name): copies[id(t)] if id(t) in copies else t.detach().clone()
            for name, t in tensors.items()}
