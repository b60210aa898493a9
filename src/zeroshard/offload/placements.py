"""Which optimizer placement the config asks for (`zero_optimization.offload_optimizer`)."""

from __future__ import annotations

import torch

from ..dist.hostsync import HostSyncs
from ..dist.streams import Streams
from .nvme_optimizer import NvmePlacement
from .optimizer import Placement


def make_placement(spec, aio, optimizer, units, owned: list[torch.Tensor], compute_dtype,
                   rank: int, master_dtype: torch.dtype = torch.float32, *,
                   syncs: HostSyncs | None = None, clip_norm: float = 0.0,
                   loss_scaling: bool = False, shards_land: bool = False,
                   streams: Streams) -> Placement:
    """The placement `offload_optimizer` asks for (`spec` None or device "none": the device),
    with masters taken from `owned` in `master_dtype` (fp32, or bf16 for bf16 master weights; NVMe
    keeps fp32, and config/refusals.py refuses bf16 masters there before anything is built).
    `shards_land`: the stage hands gradient shards over as they land (stages 2-3), so units may
    be stepped during backward (`early.py`); `streams`: the step's side streams."""
    device = spec.device if spec is not None else "none"
    if device == "nvme":
        return NvmePlacement(optimizer, units, owned, spec, aio, rank, syncs=syncs,
                             streams=streams)
    common = dict(master_dtype=master_dtype, syncs=syncs, clip_norm=clip_norm,
                  loss_scaling=loss_scaling, streams=streams)
    if device == "cpu":
        return Placement(optimizer, units, owned, compute_dtype, "cpu", spec.pin_memory,
                         step_in_backward=getattr(spec, "zeroshard_step_in_backward", None)
                         if shards_land else False,
                         **common)
    return Placement(optimizer, units, owned, compute_dtype, **common)
