"""ZeRO stage 1: optimizer state sharded; full gradients until the accumulation boundary.

Communication plan, per optimizer step:
  1. backward: autograd accumulates into each unit's full flat gradient buffer (in place, through
     the parameters' `.grad` views); micro-steps accumulate there, nothing is communicated.
  2. accumulation boundary: reduce-scatter each unit's flat gradient buffer; rank r receives the
     sum over ranks of its slice `[r*S, (r+1)*S)`, divides it by N and writes it back over its own
     slice of the buffer. Ring cost: Psi x (N-1)/N elements per rank.
  3. step: rank r steps only its shard (fp32 master + optimizer state exist only for the shard).
  4. all-gather every unit's updated shards into the full flat parameter buffer, in place.
     Ring cost: Psi x (N-1)/N elements per rank.  Total 2 x Psi x (N-1)/N, as plain DP.
"""

from __future__ import annotations

from collections import deque

import torch

from .policy import StagePolicy

# Reduce-scatters in flight at once: enough to keep gloo's threads busy, while bounding the
# temporary shard-sized receive buffers.
MAX_IN_FLIGHT = 2


class Stage1(StagePolicy):
    """Full params and grads, sharded optimizer state; reduce-scatter at the boundary."""

    stage = 1

    def reduce_gradients(self) -> None:
        """Reduce-scatter each unit's gradients and leave the average in this rank's slice."""
        n, rank = self.comm.world_size, self.comm.rank
        pending = deque()
        for unit, flat in zip(self.units, self.flat_grads):
            received = torch.empty(unit.shard_numel, dtype=flat.dtype, device=flat.device)
            pending.append((flat, unit, received,
                            self.comm.reduce_scatter(received, flat, async_op=True)))
            while len(pending) > (MAX_IN_FLIGHT if self.overlap else 0):
                self._land(pending.popleft(), n, rank)
        while pending:
            self._land(pending.popleft(), n, rank)

    @staticmethod
    def _land(item, n: int, rank: int) -> None:
        flat, unit, received, handle = item
        if handle is not None:
            handle.wait()
        unit.shard_view(flat, rank).copy_(received).div_(n)
