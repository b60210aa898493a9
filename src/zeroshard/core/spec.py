"""Frozen specs: what a stage policy is built from.

`build.py` turns the config into these once; the policy's constructor takes them and nothing
writes into a policy afterwards. The placement of masters and optimizer state (offload/) is built
before the policy, so its consequences for the policy (where gradient shards live, what dtype
they accumulate in, whether there are gradients at all) are known here already.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..dist import Comm
from .reduction import Reduction


@dataclass(frozen=True, kw_only=True)
class Stage3Options:
    """The `stage3_*` knobs (in elements) and the ZeRO++ / MiCS choices of stage 3."""

    prefetch_bucket_size: int = 50_000_000
    """Elements gathered ahead of need at any time."""
    max_live_parameters: int = 1_000_000_000
    """Prefetch and reuse never take gathered elements above this."""
    max_reuse_distance: int = 1_000_000_000
    """Keep a unit gathered if it is needed again within this many elements of other units."""
    hpz_partition_size: int = 1
    """zero_hpz_partition_size: > 1 keeps secondary shards in groups of this many ranks (`zeropp/hpz.py`)."""
    mics_replicas: Comm | None = None
    """mics_shard_size: the replica group's Comm when the policy's Comm is a MiCS shard group
    (`mics.py`); None: sharded over the whole world."""
    quantized_weights: bool = False
    """`zero_quantized_weights` (ZeRO++ qwZ): the forward/backward gathers of sharded units send
    int8 blocks (`zeropp/qwz.py`)."""
    quantized_gradients: bool = False
    """`zero_quantized_gradients` (ZeRO++ qgZ): gradients are reduced inside each host, then
    across hosts int8-quantized (more than one host only)."""


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    """One stage policy's construction parameters, decided before it is built."""

    stage: int
    """The ZeRO stage, 0-3."""
    overlap_comm: bool = True
    """Overlap gradient communication with backward (`zero_optimization.overlap_comm`)."""
    grad_place: str = "device"
    """Where persistent gradient shards live (stages 2-3): "device", or "cpu" when the optimizer
    steps there (optimizer offload)."""
    reduction: Reduction = field(default_factory=Reduction)
    """How gradients are summed and averaged (dtype, pre/post scaling)."""
    accum_dtype: torch.dtype | None = None
    """dtype of persistent gradient shards (micro-steps accumulate in it); None: the unit's."""
    keeps_gradients: bool = True
    """False for an engine without an optimizer: no gradient storage, nothing hooked for backward
    (stage 3 still gathers around forward)."""
    stage3: Stage3Options = field(default_factory=Stage3Options)
    """The stage-3 knobs (ignored below stage 3)."""
