"""ZeRO++ qgZ (`zero_quantized_gradients`): gradients reduced inside each host in full precision,
then across hosts int8-quantized (`collectives.HostGroups`; the plan is written there).

With one host, hosts of different sizes, or a data-parallel group that is not the whole world,
nothing would be quantized or it cannot run: the builder then keeps the plain reduce-scatter
(`HostGroups.for_comm` says why with a warning).
"""

from __future__ import annotations

import torch

from ..layout import Unit
from ..strategies import ReduceHandle, ReduceStrategy
from .collectives import HostGroups, block_plan
from .quantize import GRADIENT_BLOCK, BlockPlan


class HierarchicalReduce(ReduceStrategy):
    """qgZ: the two-step reduction over a host's ranks, then across hosts in int8."""

    def __init__(self, groups: HostGroups):
        """`groups`: the host and cross-host groups the two steps run over."""
        self.groups = groups
        self.plans: dict[int, BlockPlan] = {}

    def start(self, buffer: torch.Tensor, unit: Unit) -> ReduceHandle:
        """Start the host step; the cross-host step starts on the handle's `advance()` (a
        two-step `ReduceHandle`)."""
        if unit.index not in self.plans:
            self.plans[unit.index] = block_plan(unit, GRADIENT_BLOCK)
        return self.groups.reduce_scatter(buffer, unit=unit, plan=self.plans[unit.index])

    def close(self) -> None:
        """Destroy the two process groups (once)."""
        if self.groups is not None:
            self.groups.destroy()
            self.groups = None
