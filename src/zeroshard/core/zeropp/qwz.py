"""ZeRO++ qwZ (`zero_quantized_weights`): stage 3's gathers send int8 blocks with fp32 scales.

A weight codec for the gather strategy (`strategies.Gather(comm, codec=Int8Weights())`).
Communication plan, per gather of a sharded unit (forward and backward, step 1-2 of stage 3):
each rank quantizes its shard into one packed row (`collectives.quantized_all_gather`), the rows
are all-gathered as bytes over the gather's Comm, and every rank decodes all of them into the
full buffer: about Psi x (1 + 4/256) bytes per gather instead of Psi x element size. Gathers of
weights a user reads or changes (`exact`: GatheredParameters, closing the engine) and gathers
over a group of one stay exact (the gather strategy does not call the codec for them); shards,
masters and optimizer state never see quantization.
"""

from __future__ import annotations

import torch

from ...dist import Comm
from ...dist.streams import Streams
from ..layout import Unit
from ..strategies import GatherHandle
from .collectives import block_plan, packed_all_gather, quantized_all_gather
from .quantize import WEIGHT_BLOCK, BlockPlan


class Int8Weights:
    """qwZ's codec: a unit's weights on the wire as int8 blocks (cut at its parameters' starts)."""

    def __init__(self, streams: Streams):
        """`streams`: the step's (the decode reads rows gathered on the "gather" stream)."""
        self.streams = streams
        self.plans: dict[int, BlockPlan] = {}

    def _plan(self, unit: Unit) -> BlockPlan:
        if unit.index not in self.plans:
            self.plans[unit.index] = block_plan(unit, WEIGHT_BLOCK)
        return self.plans[unit.index]

    def gather(self, comm: Comm, flat: torch.Tensor, source: torch.Tensor,
               unit: Unit) -> GatherHandle:
        """Encode this rank's shard, all-gather every rank's rows over `comm`, decode into `flat`."""
        return _Decoded(quantized_all_gather(comm, flat, source, async_op=True, unit=unit,
                                             plan=self._plan(unit), streams=self.streams))

    def gather_rows(self, comm: Comm, flat: torch.Tensor, rows: torch.Tensor, total_rows: int,
                    unit: Unit) -> GatherHandle:
        """All-gather rows encoded earlier (this rank holds `rows`, consecutive rows of the
        `total_rows`) over `comm` and decode all of them into `flat` (hpZ's secondary shard)."""
        return _Decoded(packed_all_gather(comm, flat, rows, total_rows, unit, self._plan(unit),
                                          streams=self.streams))


class _Decoded(GatherHandle):
    """A quantized gather: waiting decodes every row; the rows stay readable afterwards."""

    def __init__(self, decode):
        super().__init__(None, lossy=True)
        self.decode = decode

    def wait(self) -> None:
        """Wait for the rows and decode them (once)."""
        self.decode.wait()

    def packed_rows(self) -> torch.Tensor | None:
        """Every rank's encoded row, as received (`[world, width]` uint8 once waited)."""
        return self.decode.rows_packed
