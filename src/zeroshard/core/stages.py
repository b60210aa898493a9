"""Building one stage: the units of the layout, then the policy over them with its strategies,
from a `StageSpec`.

`build.py` calls `lay_out` first (the units, full precision, already holding rank 0's values),
takes the masters from `owned_slices`, casts the units, and then calls `make_policy`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..dist import Comm
from .init_units import take_full
from .layout import Unit, build_units
from .materialize import materialize
from .partition import Stage3Layout, build_stage3_layout
from .policy import StagePolicy
from .spec import StageSpec
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3
from .strategies import Gather, Reduce, ReduceStrategy
from ..dist.streams import Streams
from .mics import ReplicaReduce
from .zeropp.collectives import HostGroups
from .zeropp.hpz import SecondaryGather, host_group_comm
from .zeropp.qgz import HierarchicalReduce
from .zeropp.qwz import Int8Weights

POLICIES = {0: Stage0, 1: Stage1, 2: Stage2}


def lay_out(model: nn.Module, group_of: dict[int, int], comm: Comm, stage: int, bucket_numel: int,
            persistence_threshold: int, unit_classes, device: torch.device
            ) -> tuple[list[Unit], Stage3Layout | None]:
    """The units of `model`'s trained parameters, every rank holding rank 0's values: whole below
    stage 3; at stage 3 only this rank's shard of each sharded unit (one unit at a time, so the
    rank never holds the whole model), frozen parameters included (`layout.frozen`). Returns the
    trained units and stage 3's layout (None below)."""
    if stage == 3:
        layout = build_stage3_layout(model, group_of, comm.world_size, bucket_numel,
                                     persistence_threshold, unit_classes, device)
        # Parameters partitioned at construction in no unit (small frozen ones, or ones that get
        # gradients no optimizer steps) are whole again; frozen units stay sharded.
        in_units = {id(p) for u in layout.units + layout.frozen for p in u.params()}
        take_full(p for p in model.parameters() if id(p) not in in_units)
        materialize(layout.units + layout.frozen, layout.persistent, comm)
        return layout.units, layout
    take_full(model.parameters())  # built under a stage-3 Init: whole again
    # named_parameters() yields a tied weight once, under its first name.
    units = build_units(list(model.named_parameters()), group_of, comm.world_size, bucket_numel,
                        device, ddp_buckets=stage == 0)
    for unit in units:
        comm.broadcast(unit.flat, src=0)
    return units, None


def owned_slices(units: list[Unit], stage: int, rank: int,
                 layout: Stage3Layout | None) -> list[torch.Tensor]:
    """The slice of each unit this rank will step (views, before the units are cast): the whole
    flat buffer at stage 0, this rank's shard of it above."""
    out = []
    for unit in units:
        if stage == 0:
            out.append(unit.flat)
        elif layout is not None and unit.index not in layout.persistent:
            out.append(unit.shard)
        else:
            out.append(unit.flat[slice(*unit.shard_bounds(rank))])
    return out


def make_policy(units: list[Unit], comm: Comm, spec: StageSpec, *, module: nn.Module,
                streams: Streams, layout: Stage3Layout | None = None, store=None, syncs=None,
                early=None) -> StagePolicy:
    """The stage policy `spec` describes; at stage 3 with its gather and reduce strategies."""
    common = dict(module=module, syncs=syncs, early=early, streams=streams)
    if spec.stage < 3:
        return POLICIES[spec.stage](units, comm, spec, **common)
    return Stage3(units, comm, spec, layout=layout, store=store,
                  gather=_gather(comm, spec, streams), reducer=_reducer(comm, spec), **common)


def _gather(comm: Comm, spec: StageSpec, streams: Streams) -> Gather:
    """Plain or through qwZ's codec (its decodes told to the step's `streams`); wrapped by hpZ
    when zero_hpz_partition_size > 1."""
    options = spec.stage3
    gather = Gather(comm, codec=Int8Weights(streams) if options.quantized_weights else None)
    if options.hpz_partition_size > 1:  # the secondary group, declared once, here
        gather = SecondaryGather(gather, host_group_comm(comm, options.hpz_partition_size))
    return gather


def _reducer(comm: Comm, spec: StageSpec) -> ReduceStrategy:
    """Plain or qgZ (where more than one host makes it change anything); wrapped by MiCS's
    replica all-reduce when the policy's Comm is a MiCS shard group."""
    options = spec.stage3
    groups = HostGroups.for_comm(comm) if options.quantized_gradients else None
    reducer = HierarchicalReduce(groups) if groups is not None else Reduce(comm)
    if options.mics_replicas is not None:
        reducer = ReplicaReduce(reducer, options.mics_replicas)
    return reducer
