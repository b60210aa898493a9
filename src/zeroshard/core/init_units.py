"""Construction-time units (`zeroshard.Init`): each partitioned parameter is its own unit holding
this rank's 1/N slice; these helpers make, gather and dissolve them.

They sit below `init.py` (the context), `gathered.py` and compat/hf/init.py, which all use them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dist import Comm, default_device
from . import extensions
from ..dist.hostmem import mark_cpu_as_host, return_freed_memory, to_device
from ..dist.world import World
from .layout import INIT_ATTR, Slot, Unit, ZeroParamStatus, padded_size, set_status


def partition_parameter(param: nn.Parameter, name: str, owner: str, comm: Comm,
                        device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Make `param` its own construction unit holding only this rank's 1/N slice (in `dtype`
    if the parameter is floating point and `dtype` is given, as DeepSpeed's Init casts).

    The parameter is copied to the compute device (a no-op when it was built there or the device
    is the CPU), rank 0's values are broadcast into that copy, the slice is copied out, and every
    full-size copy is dropped. The slice (1-D, padded) is announced to what is installed on
    top of core (extensions.py: compat/deepspeed shows it as DeepSpeed's `ds_tensor`) until an
    engine takes the parameter over.
    """
    numel = param.numel()
    kept_dtype = dtype if dtype is not None and param.is_floating_point() else param.dtype
    unit = Unit(-1, -1, kept_dtype, [Slot(param, name, 0, numel, param.shape)],
                comm.world_size, numel=numel,
                padded_numel=padded_size(numel, comm.world_size), device=device)
    unit.owner = owner
    # NCCL takes device tensors only: a module built on the CPU moves first.
    data = to_device(mark_cpu_as_host(param.data).reshape(-1), device)
    comm.broadcast(data, src=0)
    lo, hi = unit.shard_bounds(comm.rank)
    unit.shard = torch.zeros(hi - lo, dtype=kept_dtype, device=device)
    kept = max(0, min(hi, numel) - lo)
    unit.shard[:kept].copy_(data[lo:lo + kept])
    del data
    unit.release()
    setattr(param, INIT_ATTR, (unit, comm))
    extensions.construction_slice(param, unit.shard)


def leave_init_unit(param: nn.Parameter) -> None:
    """Forget `param`'s construction unit (an engine or whole storage takes over): its slice
    goes with the last reference (the extensions are told to drop theirs)."""
    delattr(param, INIT_ATTR)
    extensions.construction_slice(param, None)


def partition_new_parameters(model: nn.Module) -> None:
    """Partition (as Init does) the trainable parameters of `model` that are still whole, e.g.
    the modules Hugging Face's resize_token_embeddings builds for a partitioned model."""
    comm, device = World.current().comm, default_device()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and param.numel() and not hasattr(param, INIT_ATTR):
                partition_parameter(param, name, type(module).__name__, comm, device)
    return_freed_memory()


def init_units(model: nn.Module) -> list[Unit]:
    """The construction-time units still holding parameters of `model` (each once)."""
    units = {}
    for param in model.parameters():
        owner = getattr(param, INIT_ATTR, None)
        if owner is not None:
            units[id(owner[0])] = owner[0]
    return list(units.values())


def gather_init_units(params) -> list[Unit]:
    """Gather the construction-time units of `params` (in a rank-independent order)."""
    units, seen = [], set()
    for param in params:
        owner = getattr(param, INIT_ATTR, None)
        if owner is not None and id(owner[0]) not in seen:
            seen.add(id(owner[0]))
            units.append(owner)
    for unit, comm in units:
        if not unit.is_gathered:
            comm.all_gather(unit.allocate(), unit.shard)
            set_status(unit, ZeroParamStatus.AVAILABLE)
    return [u for u, _ in units]


def take_full(params) -> None:
    """Give construction-partitioned `params` whole storage again, one construction unit at a time."""
    pending = [p for p in params if hasattr(p, INIT_ATTR)]
    while pending:
        unit = getattr(pending[0], INIT_ATTR)[0]
        mine = [p for p in pending if getattr(p, INIT_ATTR)[0] is unit]
        gather_init_units(mine)
        wanted = {id(p) for p in mine}
        for slot, view in unit.views(unit.flat):
            if id(slot.param) in wanted:
                slot.param.data = view.clone()
                leave_init_unit(slot.param)
        # The parameters that left keep their copies; the rest stay partitioned.
        unit.slots = [s for s in unit.slots if id(s.param) not in wanted]
        unit.release()
        pending = [p for p in pending if id(p) not in wanted]
