"""ZeRO stage 1: optimizer state sharded; full gradients until the accumulation boundary.

Communication plan, per optimizer step:
  1. backward: autograd accumulates into each unit's full flat gradient buffer (in place, through
     the parameters' `.grad` views); micro-steps accumulate there, nothing is communicated.
  2. accumulation boundary: reduce-scatter each unit's flat gradient buffer in place; rank r's
     slice `[r*S, (r+1)*S)` of the buffer becomes the sum over ranks, divided by N (the rest of
     the buffer is scratch until the next zero_grad). Ring cost: Psi x (N-1)/N elements per rank.
  3. step: rank r steps only its shard (fp32 master + optimizer state exist only for the shard).
  4. all-gather every unit's updated shards into the full flat parameter buffer, in place.
     Ring cost: Psi x (N-1)/N elements per rank.  Total 2 x Psi x (N-1)/N, as plain DP.
"""

from __future__ import annotations

from collections import deque

from .policy import MAX_IN_FLIGHT, StagePolicy


class Stage1(StagePolicy):
    """Full params and grads, sharded optimizer state; reduce-scatter at the boundary."""

    stage = 1

    def reduce_gradients(self) -> None:
        """Reduce-scatter each unit's gradients and leave the average in this rank's slice."""
        pending = deque()
        for unit, flat in zip(self.units, self.flat_grads):
            pending.append((unit, flat, self.comm.reduce_scatter(flat, async_op=True,
                                                                   unit=unit)))
            while len(pending) > (MAX_IN_FLIGHT if self.overlap else 0):
                self._land(*pending.popleft())
        while pending:
            self._land(*pending.popleft())

    def _land(self, unit, flat, handle) -> None:
        if handle is not None:
            handle.wait()
        if self.comm.world_size > 1:
            unit.shard_view(flat, self.comm.rank).div_(self.comm.world_size)
