"""The one data layout of every stage: units -> flat buffers -> per-rank shards.

A *unit* is a set of parameters communicated together. Its parameters are laid end to end in one
flat buffer, padded so that it splits into `world_size` equal contiguous shards; each parameter's
`.data` is a view into that buffer. Rank r owns `[r*S, (r+1)*S)` of every unit.

For stages 0-2 units are buckets of about `bucket_numel` elements (reduce_bucket_size, capped at
1/8 of the model; at stage 0 DDP's buckets instead, `ddp_bucket_caps`) in gradient-ready order
(the reverse of registration); parameters of different optimizer param groups or dtypes never
share one. Stage 3 builds units per module instead
(`partition.py`) and keeps each one as a persistent shard whose full buffer only exists while the
unit is gathered (`Unit.shard`, `Unit.release`).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from . import extensions

# A unit is at most this fraction of the trainable parameters (but never below MIN_UNIT_NUMEL):
# at stage 2 a unit-sized gradient buffer is filled while the previous one is reduce-scattered, so
# with DeepSpeed's default bucket (5e8 elements, more than most models) a single whole-model unit
# would hold as much gradient memory as stage 1 does.
UNIT_FRACTION = 8
MIN_UNIT_NUMEL = 1 << 20

# Stage 0 keeps whole gradients whatever the unit size, so the cap above buys it nothing; its units
# are DDP's gradient buckets instead: the first (the last layers' gradients, ready first) closes
# once it holds 1 MiB, so that the first all-reduce starts early in backward, the others once they
# hold 25 MiB (or reduce_bucket_size elements, if fewer). Fewer, larger all-reduces cost less per
# step than one per 1/8 of the model (issue 37: 4 against DDP's 2 on the 3.3 M bench model).
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20

# Shards start on 16-element boundaries: aligned vector loads in the optimizer kernels and
# O_DIRECT-friendly sizes for the later NVMe placement.
ALIGN = 16

#: Attribute on a parameter partitioned at construction (zeroshard.Init): (its Unit, its Comm).
INIT_ATTR = "_zeroshard_init_unit"


class ZeroParamStatus(enum.Enum):
    """Where a stage-3 unit's parameters are (DeepSpeed's names: compat/deepspeed shows it on each
    parameter as `ds_status`)."""

    AVAILABLE = 1
    """Whole on this rank (gathered, or a persistent small parameter)."""
    NOT_AVAILABLE = 2
    """Released: empty tensors; the unit's slots keep their real shapes."""
    INFLIGHT = 3
    """Its all-gather has been issued and not yet waited for."""


def set_status(unit: "Unit", status: ZeroParamStatus) -> None:
    """Announce that `unit`'s parameters are now `status` (to what is installed on top of core,
    extensions.py; core itself keeps no per-parameter status)."""
    extensions.unit_status(unit, status)


#: The attribute through which torch.compile's OptimizedModule holds the module it wraps.
COMPILED_WRAPPER = "_orig_mod"


def plain_name(name: str) -> str:
    """`name` (of a parameter, buffer or module) without the `_orig_mod.` parts that wrapping a
    module in `torch.compile` inserts, so checkpoints move between compiled and plain models."""
    if COMPILED_WRAPPER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_WRAPPER)


def plain_named(pairs):
    """`(plain_name(name), value)` for each pair of a `named_parameters()`-style iterator."""
    return ((plain_name(name), value) for name, value in pairs)


def _construction_slot(param: nn.Parameter) -> "Slot | None":
    """`param`'s slot in its construction unit (zeroshard.Init), or None when it has none."""
    owner = getattr(param, INIT_ATTR, None)
    if owner is None:
        return None
    return next(s for s in owner[0].slots if s.param is param)


def full_shape(param: nn.Parameter) -> torch.Size:
    """A parameter's real shape, also while it is partitioned at construction."""
    slot = _construction_slot(param)
    return slot.shape if slot is not None else param.shape


def full_numel(param: nn.Parameter) -> int:
    """A parameter's real number of elements, also while it is partitioned at construction."""
    slot = _construction_slot(param)
    return slot.numel if slot is not None else param.numel()


@dataclass
class Slot:
    """Where one parameter lives inside its unit's flat buffer."""

    param: nn.Parameter
    name: str
    offset: int
    numel: int
    shape: torch.Size

    def __post_init__(self):
        # Names as in the plain model, also when it (or a block) was wrapped by torch.compile.
        self.name = plain_name(self.name)


@dataclass
class Unit:
    """One communication unit: its parameters, its flat buffer and this rank's shard bounds."""

    index: int
    group_index: int
    dtype: torch.dtype
    slots: list[Slot]
    world_size: int
    flat: torch.Tensor | None = None
    numel: int = 0
    padded_numel: int = 0
    #: Stage 3: this rank's persistent slice. `flat` then keeps its shape but its storage is
    #: emptied between gathers; parameters stay views of `flat`, so autograd's saved views of them
    #: see the data again once the storage is refilled.
    shard: torch.Tensor | None = None
    #: Stage 3: dotted names of the modules whose forward needs this unit gathered (for messages).
    owner: str = ""
    #: The compute device: where the full buffer is gathered and where released parameters say
    #: they are (the shard itself may be placed in host memory or on NVMe).
    device: torch.device | None = None

    @property
    def shard_numel(self) -> int:
        """Elements per rank (S)."""
        return self.padded_numel // self.world_size

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """`[start, end)` of rank `rank`'s shard in the flat buffer."""
        s = self.shard_numel
        return rank * s, (rank + 1) * s

    def shard_view(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The slice of a unit-sized flat `tensor` that rank `rank` owns."""
        lo, hi = self.shard_bounds(rank)
        return tensor[lo:hi]

    def views(self, flat: torch.Tensor):
        """Yield `(slot, view)` pairs: each parameter's shaped view into a unit-sized flat tensor."""
        for slot in self.slots:
            yield slot, flat[slot.offset: slot.offset + slot.numel].view(slot.shape)

    def params(self) -> list[nn.Parameter]:
        """The unit's parameters in layout order."""
        return [s.param for s in self.slots]

    def describe(self) -> str:
        """`unit 3 (blocks.1: blocks.1.attn.weight, ...)` for error messages."""
        names = [s.name for s in self.slots]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        where = f"{self.owner}: " if self.owner else ""
        return f"unit {self.index} ({where}{shown})"

    def cast(self, dtype: torch.dtype) -> None:
        """Re-lay the unit in `dtype` (mixed precision) and re-point the parameters."""
        if self.flat.dtype == dtype:
            return
        self.dtype = dtype
        if self.shard is not None:
            self.shard = self.shard.to(dtype)
            self.flat = torch.empty(self.padded_numel, dtype=dtype, device=self.compute_device)
        else:
            self.flat = self.flat.to(dtype)
        for slot, view in self.views(self.flat):
            slot.param.data = view
        if self.shard is not None:
            self.release()

    # -- stage 3: full buffer present only while gathered ----------------------------------------
    @property
    def compute_device(self) -> torch.device:
        """Where the unit is gathered and computed with."""
        if self.device is not None:
            return self.device
        return (self.flat if self.flat is not None else self.shard).device

    def partition(self, rank: int) -> None:
        """Keep only rank `rank`'s slice (a copy) and empty the full buffer's storage."""
        self.shard = self.flat[slice(*self.shard_bounds(rank))].clone()
        self.release()

    @property
    def is_gathered(self) -> bool:
        """Whether the full buffer currently has storage (always true for unsharded units)."""
        return self.flat is not None and self.flat.untyped_storage().nbytes() > 0

    def allocate(self, pool: "StoragePool | None" = None) -> torch.Tensor:
        """Give the full buffer storage (contents undefined), point the parameters at it, return it."""
        if self.flat is None:  # partitioned without ever having one (zeroshard.Init)
            self.flat = torch.empty(self.padded_numel, dtype=self.dtype, device=self.compute_device)
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            nbytes = self.padded_numel * self.flat.element_size()
            if pool is not None:
                pool.lend(storage, nbytes)
            else:
                storage.resize_(nbytes)
        for slot, view in self.views(self.flat):
            slot.param.data = view
        set_status(self, ZeroParamStatus.INFLIGHT)
        return self.flat

    def release(self, pool: "StoragePool | None" = None, detach: bool = False) -> None:
        """Free the full buffer's storage; parameters hold empty tensors until the next gather.

        The storage object itself stays: views of it that autograd saved in forward see the data
        again once the unit is gathered for backward. The parameters are re-pointed at an empty
        tensor (real shape in its slot), so touching one while released is an ordinary error.

        With `detach` (the end of a GatheredParameters context) the unit lets go of the buffer
        instead of emptying it: a tensor the user kept from inside the context (`p.data.cpu()`
        is `p.data` itself on the CPU) keeps its values, as in DeepSpeed, and the memory goes
        when the last such reference does. The next gather starts a new buffer.
        """
        if detach and self.flat is not None:
            self.flat = None
        if self.flat is not None and self.flat.untyped_storage().nbytes() > 0:
            if pool is not None:
                pool.take_back(self.flat.untyped_storage())
            else:
                self.flat.untyped_storage().resize_(0)
        # On the compute device, wherever the shard is placed: `next(model.parameters()).device`
        # and Hugging Face's `model.device` must name the device the model computes on.
        empty = torch.empty(0, dtype=self.dtype, device=self.compute_device)
        for slot in self.slots:
            slot.param.data = empty
        set_status(self, ZeroParamStatus.NOT_AVAILABLE)


class StoragePool:
    """Memory for gathered stage-3 units, reused instead of freed (glibc keeps freed 28 MB blocks
    in a fragmented heap: measured +380 MiB RSS over 4 steps of the bench model without a pool).

    A unit's full-buffer storage object must stay the same (autograd saved views of it), so the
    pool moves the *bytes*: `lend` swaps a spare block's data pointer into the unit's empty
    storage, `take_back` swaps it out into a spare again. Blocks are kept per (device, size);
    their number is bounded by how many units of that size are ever gathered at once (so by
    stage3_max_live_parameters). It plays on the host the part CUDA's caching allocator plays on
    a GPU (where no pool is made); `engine.empty_partition_cache()` empties it, and
    `get_accelerator().empty_cache()` empties every pool of the process (as torch.cuda.empty_cache).
    """

    live: "weakref.WeakSet[StoragePool]" = weakref.WeakSet()

    def __init__(self):
        self.free: dict[tuple[str, int], list[torch.UntypedStorage]] = {}
        self.fresh = 0  # blocks allocated because no spare one fitted
        StoragePool.live.add(self)

    def lend(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Fill an empty `storage` with `nbytes` bytes from the pool (or fresh memory)."""
        spare = self.free.get((str(storage.device), nbytes))
        if spare:
            block = spare.pop()
        else:
            block = torch.UntypedStorage(nbytes, device=storage.device)
            self.fresh += 1
        storage._swap_data_ptr_(block)

    def take_back(self, storage: torch.UntypedStorage) -> None:
        """Move `storage`'s bytes into the pool, leaving it empty."""
        key = (str(storage.device), storage.nbytes())
        block = torch.UntypedStorage(0, device=storage.device)
        storage._swap_data_ptr_(block)
        self.free.setdefault(key, []).append(block)

    def clear(self) -> None:
        """Give every spare block back to the host allocator."""
        self.free.clear()

    def tensors(self) -> list[torch.Tensor]:
        """Spare blocks as byte tensors (for the memory ledger)."""
        return [torch.empty(0, dtype=torch.uint8, device=b.device).set_(b)
                for blocks in self.free.values() for b in blocks]


def padded_size(numel: int, world_size: int) -> int:
    """Round `numel` up so that it splits into `world_size` shards of ALIGN-multiple length."""
    quantum = world_size * ALIGN
    return max(quantum, -(-numel // quantum) * quantum)


def unit_numel_cap(bucket_numel: int, trainable_numel: int) -> int:
    """Largest unit: the bucket size, capped at 1/UNIT_FRACTION of the model (>= MIN_UNIT_NUMEL)."""
    return min(bucket_numel, max(trainable_numel // UNIT_FRACTION, MIN_UNIT_NUMEL))


def ddp_bucket_caps(bucket_numel: int, ready_order) -> tuple[int, int]:
    """Stage 0's unit sizes in elements, for the parameters' element size and neither above
    `bucket_numel`: DDP's first bucket, then the others (each closed by the parameter that
    reaches its size, as DDP closes its buckets)."""
    size = ready_order[0][1].element_size() if ready_order else 4
    return (min(bucket_numel, DDP_FIRST_BUCKET_BYTES // size),
            min(bucket_numel, DDP_BUCKET_BYTES // size))


def build_units(named_params: list[tuple[str, nn.Parameter]], group_of: dict[int, int],
                world_size: int, bucket_numel: int, device: torch.device | None = None,
                materialize: bool = True, ddp_buckets: bool = False) -> list[Unit]:
    """Pack trainable parameters into units in gradient-ready order (and flatten them onto
    `device`, the parameters' own device if None, unless `materialize` is false).

    `named_params` is in registration order; `group_of` maps `id(param)` to its optimizer param-group
    index (parameters absent from it are not managed). Units hold at most
    `unit_numel_cap(bucket_numel, trainable)` elements (a larger single parameter gets its own);
    with `ddp_buckets` (stage 0) they are DDP's buckets instead (`ddp_bucket_caps`).
    Flat buffers keep the parameters' own dtype; `Unit.cast` re-lays them for mixed precision.
    """
    ready_order = [(n, p) for n, p in reversed(named_params) if id(p) in group_of]
    first_numel = None
    if ddp_buckets:
        first_numel, bucket_numel = ddp_bucket_caps(bucket_numel, ready_order)
    else:
        bucket_numel = unit_numel_cap(bucket_numel, sum(full_numel(p) for _, p in ready_order))
    position = {id(p): i for i, (_, p) in enumerate(ready_order)}
    open_units: dict[tuple[int, torch.dtype], list[Slot]] = {}
    open_numel: dict[tuple[int, torch.dtype], int] = {}
    closed: list[tuple[int, int, torch.dtype, list[Slot]]] = []  # (ready position, group, dtype, slots)

    def close(key):
        slots = open_units.pop(key)
        closed.append((max(position[id(s.param)] for s in slots), key[0], key[1], slots))
        open_numel[key] = 0

    firsts = set()  # keys whose first unit is closed (DDP's buckets)
    for name, param in ready_order:
        key = (group_of[id(param)], param.dtype)
        if first_numel is None and key in open_units and \
                open_numel[key] + full_numel(param) > bucket_numel:
            close(key)
        slots = open_units.setdefault(key, [])
        offset = open_numel.get(key, 0)
        slots.append(Slot(param, name, offset, full_numel(param), full_shape(param)))
        open_numel[key] = offset + full_numel(param)
        if first_numel is not None and \
                open_numel[key] >= (bucket_numel if key in firsts else first_numel):
            close(key)  # as DDP's buckets: closed by the parameter that fills them
            firsts.add(key)
    for key in list(open_units):
        close(key)
    # A unit is ready when its last parameter's gradient arrives: order units by that moment.
    closed.sort(key=lambda item: item[0])
    units = []
    for index, (_, group, unit_dtype, slots) in enumerate(closed):
        unit = Unit(index, group, unit_dtype, slots, world_size, device=device)
        unit.numel = sum(s.numel for s in slots)
        unit.padded_numel = padded_size(unit.numel, world_size)
        if materialize:
            flatten(unit)
        units.append(unit)
    return units


def flatten(unit: Unit) -> None:
    """Allocate the unit's flat buffer on its compute device, copy the parameters in (from
    wherever they are: host memory for a model built on the CPU), make each `param.data` a view."""
    device = unit.device or unit.slots[0].param.device
    unit.device = device
    flat = torch.zeros(unit.padded_numel, dtype=unit.dtype, device=device)
    for slot, view in unit.views(flat):
        view.copy_(slot.param.detach(), non_blocking=slot.param.is_pinned())
        # Re-pointing .data frees the parameter's old storage: no full-size copy stays alive.
        slot.param.data = view
    unit.flat = flat
