"""ZeRO++'s quantized collectives: qwZ's int8 weight all-gather and qgZ's host-hierarchical
gradient reduce-scatter with int8 between hosts (codec: `quantize.py`).

qwZ (`quantized_all_gather`). Each rank quantizes its shard (S values, blocks of WEIGHT_BLOCK)
into one packed row of `packed_size(S)` bytes (int8 values and fp32 block scales together, and
the unit's 1-D parameters exact as fp32), the rows are all-gathered as uint8 through the world's
`Comm`, and every rank decodes all N rows, its own included, into the full buffer in the
compute dtype. Decoding the own row too keeps the gathered weights identical
on every rank (all ranks compute with the same weights); the shard itself, the fp32 masters and
the optimizer state never see the quantization. Wire bytes: packed_size(S) per row instead of
S x element size (about 1/4 of fp32, 1/2 of bf16/fp16).

qgZ (`HostGroups.reduce_scatter`), for N = H hosts x P ranks (torchrun's layout: global rank
r = h*P + l on host h, local rank l). The unit's gradient buffer holds N slots of S values; slot
r is rank r's after the reduction. Plan:
  1. (no step: the buffer is viewed as [H, P, S]; local rank l's piece is column l, the slots
     (h, l) of every host h, H pieces apart);
  2. reduce-scatter in full precision (the reduction's dtype) inside the host, piece by piece
     (`Comm.reduce_scatter_rows`: no copy on gloo): local rank l now has its host's sums of the
     slots (0, l), (1, l), ... (H-1, l), in place;
  3. across hosts, between the H ranks with local rank l: send host h' the slot (h', l)
     quantized in blocks of GRADIENT_BLOCK cut at parameter starts (one all-to-all of packed
     rows), and add the H-1 rows that arrive, decoded in fp32, into this host's own (exact) sum
     of slot (h, l), which is this rank's slot, in place.
Steps 1-2 start at once; step 3's exchange starts when the next unit launches (`advance`) and
is waited one launch later (stage 2/3's in-flight queue), so it overlaps backward.
Only step 3 crosses hosts, with packed_size(S) bytes per peer host instead of P x S x element
size per host under a flat ring. Quantizing happens on partial sums, so `core/reduction.py`'s
pre-division and dtype apply unchanged before step 1 and its post-division after step 3.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ...dist import Comm
from ...dist.groups import blocks, split, strided
from ...dist.streams import Streams
from .quantize import (GRADIENT_BLOCK, WEIGHT_BLOCK, BlockPlan, dequantize, dequantize_into,
                       packed_size, quantize, quantize_into)


def block_plan(unit, block: int) -> BlockPlan:
    """The BlockPlan of `unit`'s shard rows: blocks cut at its parameters' starts, parameters of
    fewer than two dimensions (biases, norms) sent exact."""
    return BlockPlan([slot.offset for slot in unit.slots], unit.shard_numel, block,
                     unit.world_size,
                     [(slot.offset, slot.numel) for slot in unit.slots if len(slot.shape) < 2])


class _DecodeGather:
    """An in-flight quantized all-gather; waiting decodes every row into the output buffer."""

    def __init__(self, handle, packed: torch.Tensor, output: torch.Tensor, rows: int,
                 plan: BlockPlan | None, streams: Streams):
        self.handle, self.packed, self.output, self.rows = handle, packed, output, rows
        self.plan, self.streams = plan, streams
        self.rows_packed: torch.Tensor | None = None

    def wait(self) -> None:
        """Wait for the gather and decode it (once)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.packed is not None:
            self.rows_packed = self.packed  # what was decoded (hpZ keeps its group's rows)
            numel = self.output.numel() // self.rows
            plan = self.plan
            fix = plan.fixups(range(self.rows), self.packed.device) if plan else None
            dequantize_into(self.packed.view(self.rows, -1), self.output.view(self.rows, numel),
                            WEIGHT_BLOCK, fix, plan.extra if plan else 0)
            # Made on the gather stream, read here on the waiting one: the caching allocator must
            # not hand it out again before this decode has run.
            self.streams.keep_until_used(self.packed)
            self.packed = None


def quantized_all_gather(comm: Comm, output: torch.Tensor, shard: torch.Tensor,
                         async_op: bool = False, unit=None, plan: BlockPlan | None = None, *,
                         streams: Streams):
    """qwZ: gather every rank's `shard` into `output` (rank order), int8-quantized on the wire
    in blocks cut by `plan` (the unit's, from `block_plan`; None: every WEIGHT_BLOCK elements);
    every slot of `output`, this rank's too, holds decoded values. The ledger counts the packed
    bytes (`Comm.all_gather` on uint8). `streams`: the step's, which keep the packed rows made on
    a side stream until the decode that reads them has run."""
    rows = comm.world_size
    numel = shard.numel()
    if output.numel() != rows * numel:
        raise ValueError(f"quantized_all_gather: output has {output.numel()} elements, expected "
                         f"{rows} x {numel} (unit {getattr(unit, 'index', '?')})")
    extra = plan.extra if plan is not None else 0
    width = packed_size(numel, WEIGHT_BLOCK, extra)
    packed = torch.empty(rows * width, dtype=torch.uint8, device=shard.device)
    own = packed[comm.rank * width:(comm.rank + 1) * width]
    fix = plan.fixups([comm.rank], shard.device) if plan is not None else None
    quantize_into(shard.reshape(1, numel), own.view(1, width), WEIGHT_BLOCK, fix, extra)
    handle = comm.all_gather(packed, own, async_op=True, unit=unit)
    gather = _DecodeGather(handle, packed, output, rows, plan, streams)
    return gather if async_op else gather.wait()


def packed_all_gather(comm: Comm, output: torch.Tensor, rows_packed: torch.Tensor, rows: int,
                      unit=None, plan: BlockPlan | None = None, *, streams: Streams):
    """hpZ under qwZ: gather rows already packed by `quantized_all_gather` (this rank holds
    `rows_packed`, [rows / comm.world_size, width] uint8, its group's consecutive rows) and
    decode all `rows` into `output`: the same weights the packed rows first decoded to."""
    packed = torch.empty(rows * rows_packed.shape[1], dtype=torch.uint8,
                         device=rows_packed.device)
    handle = comm.all_gather(packed, rows_packed.view(-1), async_op=True, unit=unit)
    return _DecodeGather(handle, packed, output, rows, plan, streams)


class HostGroups:
    """The two process groups of qgZ's hierarchy, as `Comm`s that count into the world's ledger:
    the P ranks of this host, and the H ranks (one per host) sharing this rank's local rank."""

    def __init__(self, comm: Comm, ranks_per_host: int):
        world = comm.world_size
        self.per_host = ranks_per_host
        self.hosts = world // ranks_per_host
        self.host, self.local = divmod(comm.rank, ranks_per_host)
        self.rank = comm.rank
        # One ledger and one watchdog deadline for the step's collectives (dist/groups.py).
        self.intra = split(comm, blocks(world, ranks_per_host))
        self.inter = split(comm, strided(world, ranks_per_host))

    @classmethod
    def for_comm(cls, comm: Comm) -> "HostGroups | None":
        """The groups for the world `comm` spans, or None where qgZ would change nothing (one
        host) or cannot run (hosts of different sizes, or `comm` not the whole world)."""
        per_host = comm.layout.ranks_per_host
        world = comm.world_size
        if comm.group is not None and world != dist.get_world_size():
            warnings.warn("zero_quantized_gradients: the data-parallel group is not the whole "
                          "world; gradients are reduced unquantized", RuntimeWarning, stacklevel=2)
            return None
        if per_host >= world:
            return None  # one host: nothing crosses hosts, so nothing is quantized
        if world % per_host:
            warnings.warn(f"zero_quantized_gradients: {world} ranks do not split into hosts of "
                          f"LOCAL_WORLD_SIZE={per_host}; gradients are reduced unquantized",
                          RuntimeWarning, stacklevel=2)
            return None
        return cls(comm, per_host)

    def reduce_scatter(self, full: torch.Tensor, unit=None, plan: BlockPlan | None = None):
        """qgZ: start summing `full` over every rank into this rank's slot of it (the same slot
        a plain `Comm.reduce_scatter` fills), quantized across hosts in blocks cut by `plan`;
        returns a handle whose `wait()` finishes it."""
        return _HierarchicalReduceScatter(self, full, unit, plan)

    def destroy(self) -> None:
        """Destroy the two process groups (this rank's)."""
        for side in (self.intra, self.inter):
            if side.group is not None and dist.is_initialized():
                dist.destroy_process_group(side.group)


class _HierarchicalReduceScatter:
    """Steps 1-2 of the module's qgZ plan start at once; `advance()` waits for them and starts
    step 3's exchange (stage 2/3 call it when the next unit launches, so the slow link's transfer
    overlaps backward); `wait()` finishes step 3 (advancing first if nobody did). A two-step
    `strategies.ReduceHandle`."""

    steps = 2

    def __init__(self, groups: HostGroups, full: torch.Tensor, unit=None,
                 plan: BlockPlan | None = None):
        self.groups, self.full, self.unit, self.plan = groups, full, unit, plan
        hosts, per_host = groups.hosts, groups.per_host
        self.numel = full.numel() // (hosts * per_host)
        # Local rank l reduces the slots (h, l) of every host h: rows [H, P, S], pieces H apart.
        self.slots = full.view(hosts, per_host, self.numel)
        self.handle = groups.intra.reduce_scatter_rows(self.slots, async_op=True, unit=unit)
        self.exchange = self.send = self.received = None

    def advance(self) -> None:
        """Finish the host reduce-scatter and start the quantized exchange across hosts."""
        if self.full is None or self.received is not None:
            return
        groups = self.groups
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        rows = self.slots[:, groups.local]  # [H, S]: this host's sums of slots (h, l)
        others = [h for h in range(groups.hosts) if h != groups.host]
        # Row h of `rows` is shard row (h, l) of the unit; every row received is this rank's.
        send = quantize(rows[others], GRADIENT_BLOCK, self.plan,
                        [h * groups.per_host + groups.local for h in others])
        self.send, self.received = send, torch.empty_like(send)  # both live until wait()
        width = send.shape[1]
        splits = [0 if h == groups.host else width for h in range(groups.hosts)]
        self.exchange = groups.inter.all_to_all(self.received.view(-1), send.view(-1), splits,
                                                splits, async_op=True, unit=self.unit)

    def wait(self) -> None:
        """Finish the exchange across hosts and add what arrived into this rank's slot."""
        if self.full is None:
            return
        self.advance()
        if self.exchange is not None:
            self.exchange.wait()
            self.exchange = None
        groups = self.groups
        own = self.slots[groups.host, groups.local]  # slot (host, l): this rank's, in `full`
        arrived = dequantize(self.received, self.numel, torch.float32, GRADIENT_BLOCK, self.plan,
                             [groups.rank] * (groups.hosts - 1)).sum(dim=0)
        if own.dtype == torch.float32:
            own.add_(arrived)
        else:  # summed in fp32, stored in the reduction dtype
            own.copy_(arrived.add_(own))
        self.slots = self.full = self.send = self.received = None
