"""ZeRO++ qwZ (`zero_quantized_weights`): stage 3's gathers send int8 blocks with fp32 scales.

Communication plan, per gather of a sharded unit (forward and backward, step 1-2 of stage 3):
each rank quantizes its shard into one packed row (`collectives.quantized_all_gather`), the rows
are all-gathered as bytes over the policy's Comm, and every rank decodes all of them into the
full buffer: about Psi x (1 + 4/256) bytes per gather instead of Psi x element size. Gathers of
weights a user reads or changes (`exact`: GatheredParameters, closing the engine) and gathers
over a group of one stay exact; shards, masters and optimizer state never see quantization.
"""

from __future__ import annotations

import torch

from ...dist import Comm
from ...dist.streams import Streams
from ..layout import Unit
from ..strategies import Gather
from .collectives import block_plan, quantized_all_gather
from .quantize import WEIGHT_BLOCK, BlockPlan


class QuantizedGather(Gather):
    """qwZ: int8 all-gathers of the sharded units, exact where asked."""

    def __init__(self, comm: Comm, streams: Streams):
        super().__init__(comm)
        #: The step's side streams (the decode reads rows gathered on the "gather" stream).
        self.streams = streams
        self.plans: dict[int, BlockPlan] = {}

    def plan(self, unit: Unit) -> BlockPlan:
        """`unit`'s weight blocks (cut at its parameters' starts), made once."""
        if unit.index not in self.plans:
            self.plans[unit.index] = block_plan(unit, WEIGHT_BLOCK)
        return self.plans[unit.index]

    def start(self, flat: torch.Tensor, source: torch.Tensor, unit: Unit, exact: bool):
        """An int8 gather (lossy) unless `exact` or the group is one rank."""
        if exact or self.comm.world_size == 1:
            return super().start(flat, source, unit, exact)
        return quantized_all_gather(self.comm, flat, source, async_op=True, unit=unit,
                                    plan=self.plan(unit), streams=self.streams), True
