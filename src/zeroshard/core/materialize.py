"""Stage 3 at `initialize()`: the units take their place one at a time, never the whole model.

Communication plan, once, unit by unit in layout order (each rank walks the same units):
  - a unit of an ordinarily built model: its parameters are copied into a unit-sized flat buffer
    on the compute device (from host memory for a model built on the CPU, whose copies are
    freed as they move), rank 0's buffer is broadcast (every rank starts from rank 0's values, as
    with DDP), this rank keeps its 1/N slice and the full buffer is freed before the next unit.
    Ring cost: Psi x (N-1)/N elements per rank over the whole model, one unit in memory at a time.
  - a unit whose parameters were partitioned at construction (`zeroshard.Init`: each parameter
    is its own construction unit, split 1/N per rank) is re-laid with one all-to-all: every rank
    sends each peer the parts of its construction slices that fall in that peer's slice of the
    unit. Nothing is gathered; each rank sends at most its own Psi/N.
  - a persistent unit (small parameters, whole on every rank) is flattened and broadcast whole.
Peak memory: the shards so far plus one unit (about three 1/N slices of it for a re-laid one).
"""

from __future__ import annotations

import torch

from ..dist import Comm
from ..dist.hostmem import return_freed_memory
from .init_units import leave_init_unit, take_full
from .layout import INIT_ATTR, Unit, flatten


def materialize(units: list[Unit], persistent: set[int], comm: Comm) -> None:
    """Give every unit its memory on its compute device: sharded units keep only this rank's
    slice (`unit.shard`, the full buffer released), persistent ones the whole flat buffer."""
    for unit in units:
        params = [s.param for s in unit.slots]
        built_on_host = any(p.device.type == "cpu" for p in params)
        if unit.index not in persistent and params and all(hasattr(p, INIT_ATTR) for p in params):
            relay_init_shards(unit, comm)
        else:
            take_full(params)  # a few construction-partitioned ones: small or mixed units
            flatten(unit)
            comm.broadcast(unit.flat, src=0)
            if unit.index not in persistent:
                unit.partition(comm.rank)
        if built_on_host:
            return_freed_memory()


def _pieces(unit: Unit, src: int, dst: int) -> list[tuple[int, int, int]]:
    """(slot position, start, end) in parameter coordinates of what rank `src` holds from
    construction and rank `dst` owns in `unit`, in slot order."""
    lo, hi = unit.shard_bounds(dst)
    out = []
    for position, slot in enumerate(unit.slots):
        built, _ = getattr(slot.param, INIT_ATTR)
        own = next(s for s in built.slots if s.param is slot.param)
        held_lo, held_hi = built.shard_bounds(src)
        start = max(lo - slot.offset, held_lo - own.offset, 0)
        end = min(hi - slot.offset, held_hi - own.offset, slot.numel)
        if start < end:
            out.append((position, start, end))
    return out


def _held(slot_param, start: int, end: int) -> torch.Tensor:
    """Elements `[start, end)` of a construction-partitioned parameter, from this rank's slice."""
    built, comm = getattr(slot_param, INIT_ATTR)
    own = next(s for s in built.slots if s.param is slot_param)
    base = built.shard_bounds(comm.rank)[0] - own.offset
    return built.shard[start - base:end - base]


def relay_init_shards(unit: Unit, comm: Comm) -> None:
    """Re-lay a unit built under `zeroshard.Init` from its construction slices into this rank's
    stage-3 shard with one all-to-all (no parameter is gathered)."""
    world, rank = comm.world_size, comm.rank
    device = unit.compute_device
    sends = [_pieces(unit, rank, dst) for dst in range(world)]
    recvs = [_pieces(unit, src, rank) for src in range(world)]
    parts = [_held(unit.slots[i].param, a, b).to(device) for pieces in sends for i, a, b in pieces]
    send = torch.cat(parts) if parts else torch.zeros(0, dtype=unit.dtype, device=device)
    send_sizes = [sum(b - a for _, a, b in pieces) for pieces in sends]
    recv_sizes = [sum(b - a for _, a, b in pieces) for pieces in recvs]
    received = torch.empty(sum(recv_sizes), dtype=unit.dtype, device=device)
    comm.all_to_all(received, send, recv_sizes, send_sizes)
    del send, parts
    shard = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=device)  # padding stays 0
    lo = unit.shard_bounds(rank)[0]
    at = 0
    for pieces in recvs:
        for position, start, end in pieces:
            begin = unit.slots[position].offset + start - lo
            shard[begin:begin + end - start].copy_(received[at:at + end - start])
            at += end - start
    unit.shard = shard
    unit.flat = torch.empty(unit.padded_numel, dtype=unit.dtype, device=device)
    for slot in unit.slots:
        leave_init_unit(slot.param)  # its construction slice goes with the last reference
    unit.release()
