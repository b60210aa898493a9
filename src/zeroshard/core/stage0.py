"""ZeRO stage 0: plain data parallelism on the zeroshard layout (our DDP baseline).

Communication plan, per optimizer step:
  1. backward: autograd accumulates each parameter's gradient in place into its unit's full flat
     gradient buffer (micro-steps accumulate there too); nothing is communicated.
  2. accumulation boundary: all-reduce (sum) every unit's flat gradient buffer, then divide by N.
     Ring cost: 2 x Psi x (N-1)/N elements per rank.
  3. step: every rank steps the whole of every unit (optimizer state is fully replicated); the
     parameters are views into the flat buffers, so they are current with no further collective.
"""

from __future__ import annotations

from ..comm import wait_all
from .policy import StagePolicy


class Stage0(StagePolicy):
    """Full params, full grads, full optimizer state; all-reduce at the boundary."""

    stage = 0
    shards_optimizer = False

    def reduce_gradients(self) -> None:
        """All-reduce every unit's full gradient buffer and average it."""
        handles = [self.comm.all_reduce(flat, async_op=True, unit=unit)
                   for unit, flat in zip(self.units, self.flat_grads)]
        wait_all(handles)
        if self.comm.world_size > 1:
            for flat in self.flat_grads:
                flat.div_(self.comm.world_size)

    def gather_params(self) -> None:
        """Nothing to gather: every rank stepped the full parameters."""
