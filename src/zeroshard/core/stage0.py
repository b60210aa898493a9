"""ZeRO stage 0: plain data parallelism on the zeroshard layout (our DDP baseline).

Communication plan, per optimizer step:
  1. backward: autograd accumulates each parameter's gradient in place into its unit's full flat
     gradient buffer (micro-steps accumulate there too); nothing is communicated.
  2. accumulation boundary: all-reduce (sum) every unit's flat gradient buffer, cast to the
     communication dtype first (`reduction.py`: fp32 for fp16/bf16 gradients by default; in place
     when it already is), then divide by N. Ring cost: 2 x Psi x (N-1)/N elements per rank.
  3. step: every rank steps the whole of every unit (optimizer state is fully replicated); the
     parameters are views into the flat buffers, so they are current with no further collective.
"""

from __future__ import annotations

import torch

from ..comm import wait_all
from .policy import StagePolicy


class Stage0(StagePolicy):
    """Full params, full grads, full optimizer state; all-reduce at the boundary."""

    stage = 0
    shards_optimizer = False

    def setup(self) -> None:
        """Full gradient buffers (as the base policy) and no reduced copies yet."""
        super().setup()
        self.reduced: dict[int, torch.Tensor] = {}

    def reduce_gradients(self) -> None:
        """All-reduce every unit's full gradient buffer (in the communication dtype), average it."""
        n = self.comm.world_size
        sends = [self.reduction.for_reduce(flat, n) for flat in self.flat_grads]
        handles = [self.comm.all_reduce(send, async_op=True) for send in sends]
        wait_all(handles)
        for unit, send in zip(self.units, sends):
            self.reduced[unit.index] = self.reduction.after(send, n)

    def grad_shard(self, unit) -> torch.Tensor:
        """The unit's averaged gradient (in the communication dtype) once reduced."""
        reduced = self.reduced.get(unit.index)
        return reduced if reduced is not None else super().grad_shard(unit)

    def zero_grad(self) -> None:
        """Clear the full buffers and forget the reduced copies."""
        self.reduced.clear()
        super().zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Full gradient buffers, plus reduced copies in another dtype (between reduce and step)."""
        flats = {t.data_ptr() for t in self.flat_grads}
        return super().grad_tensors() + [t for t in self.reduced.values()
                                         if t.data_ptr() not in flats]

    def gather_params(self) -> None:
        """Nothing to gather: every rank stepped the full parameters."""
