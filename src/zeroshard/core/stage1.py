"""ZeRO stage 1: optimizer state sharded; full gradients until the accumulation boundary.

Communication plan, per optimizer step:
  1. backward: autograd accumulates into each unit's full flat gradient buffer (in place, through
     the parameters' `.grad` views); micro-steps accumulate there, nothing is communicated.
  2. accumulation boundary: each unit's flat gradient buffer, cast to the communication dtype
     (`reduction.py`: fp32 for fp16/bf16 gradients unless `communication_data_type` says
     otherwise; in place when it already is in that dtype) and pre-scaled, is reduce-scattered;
     rank r's slice `[r*S, (r+1)*S)` becomes the sum over ranks, divided by N (the rest is scratch).
     Ring cost: Psi x (N-1)/N elements of the communication dtype per rank.
  3. step: rank r steps only its shard (fp32 master + optimizer state exist only for the shard).
  4. all-gather every unit's updated shards into the full flat parameter buffer, in place.
     Ring cost: Psi x (N-1)/N elements per rank.  Total 2 x Psi x (N-1)/N, as plain DP.
"""

from __future__ import annotations

from collections import deque

import torch

from ..dist import Comm
from .layout import Unit
from .policy import MAX_IN_FLIGHT, FullGradients, StagePolicy, reattach_hook
from .spec import StageSpec
from ..dist.streams import Streams


class Stage1(StagePolicy):
    """Full params and grads, sharded optimizer state; reduce-scatter at the boundary."""

    stage = 1

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *,
                 module: torch.nn.Module | None, streams: Streams, syncs=None, early=None):
        """Full gradient buffers with the parameters' `.grad` views (`syncs` / `early` unused:
        nothing is reduced in backward)."""
        super().__init__(units, comm, spec, module=module, streams=streams)
        self.grads = FullGradients(units, spec.keeps_gradients)
        self.grads.hook(self.hooks, lambda unit, slot, view: reattach_hook(view))
        self.reduced: dict[int, torch.Tensor] = {}  # unit index -> this rank's averaged slice

    def reduce_gradients(self) -> None:
        """Reduce-scatter each unit's gradients and keep the average of this rank's slice."""
        pending = deque()
        n = self.comm.world_size
        for unit, flat in zip(self.units, self.grads.flats):
            send = self.reduction.for_reduce(flat, n)  # a communication-dtype copy, or flat itself
            pending.append((unit, send, self.comm.reduce_scatter(send, async_op=True,
                                                                   unit=unit)))
            while len(pending) > (MAX_IN_FLIGHT if self.overlap else 0):
                self._land(*pending.popleft())
        while pending:
            self._land(*pending.popleft())

    def _land(self, unit, send, handle) -> None:
        if handle is not None:
            handle.wait()
        own = self.reduction.after(unit.shard_view(send, self.comm.rank), self.comm.world_size)
        # A cast copy is let go at once: only this rank's slice of it is kept.
        is_flat = send.data_ptr() == self.grads.flats[unit.index].data_ptr()
        self.reduced[unit.index] = own if is_flat else own.clone()

    def grad_shard(self, unit) -> torch.Tensor:
        """This rank's averaged slice (in the communication dtype) once reduced, else the
        not yet averaged slice of the full buffer."""
        reduced = self.reduced.get(unit.index)
        if reduced is not None:
            return reduced
        lo, hi = self.owned_bounds(unit)
        return self.grads.flats[unit.index][lo:hi]

    def zero_grad(self) -> None:
        """Clear the full buffers and forget the reduced slices."""
        self.reduced.clear()
        self.grads.zero()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Full gradient buffers, plus reduced slices that are copies (between reduce and step)."""
        flats = {t.untyped_storage().data_ptr() for t in self.grads.flats}
        return list(self.grads.flats) + [t for t in self.reduced.values()
                                         if t.untyped_storage().data_ptr() not in flats]
