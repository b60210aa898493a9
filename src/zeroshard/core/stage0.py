"""ZeRO stage 0: plain data parallelism on the zeroshard layout (our DDP baseline).

Communication plan, per optimizer step:
  1. backward: autograd accumulates each parameter's gradient in place into its unit's full flat
     gradient buffer (micro-steps accumulate there too). In the backward of the accumulation
     boundary (`expect_boundary`, told by the engine; every backward when nobody says), as DDP
     does with its buckets: as soon as a unit's gradients are all in (post-accumulate-grad
     hooks), and every unit before it in the layout's gradient-ready order has been launched, a
     copy of its buffer in the communication dtype (`reduction.py`: fp32 for fp16/bf16 gradients
     by default) is all-reduced asynchronously while backward goes on. The copy keeps the
     collective apart from autograd, which may still write the buffer (a parameter whose
     gradient comes again, e.g. in a reentrant checkpoint, marks its unit to be reduced again
     at the boundary). At most MAX_IN_FLIGHT copies are out at once (policy.py, as at stages
     1-2): launching one more lands the oldest, whose average goes back into its gradient buffer
     and whose copy is freed, so the copies hold a unit or two of gradients, not a second
     model's worth (DDP's buckets are one).
     End of backward (an autograd callback): units never completed (unused parameters) are
     launched in order, and every all-reduce is waited for and divided by N.
  2. accumulation boundary: units whose buffer changed since their all-reduce was launched (or
     that no backward reduced: overlap off, world of one) are all-reduced now, in layout order.
     Ring cost either way: 2 x Psi x (N-1)/N elements of the communication dtype per rank.
  3. step: every rank steps the whole of every unit (optimizer state is fully replicated); the
     parameters are views into the flat buffers, so they are current with no further collective.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import torch

from ..dist import wait_all
from .layout import Unit
from .policy import MAX_IN_FLIGHT, StagePolicy


class Stage0(StagePolicy):
    """Full params, full grads, full optimizer state; all-reduce overlapped with backward."""

    stage = 0
    shards_optimizer = False

    def _attach(self) -> None:
        """Full gradient buffers (as the base policy), plus the hooks that overlap the all-reduce."""
        super()._attach()
        self.reduced: dict[int, torch.Tensor] = {}
        self.dirty = {u.index for u in self.units}  # buffers changed since their reduction
        self.armed = True
        self.in_flight = deque()
        self._clear_backward()
        if not (self.overlap and self.module is not None and self.comm.world_size > 1
                and self.keeps_gradients):
            return
        self.hooks.append(self.module.register_forward_hook(self._hook_outputs))
        for unit in self.units:
            for slot in unit.slots:  # after `_reattach_hook`: the gradient is in the buffer
                self.hooks.append(slot.param.register_post_accumulate_grad_hook(
                    partial(self._on_grad_ready, unit)))

    def expect_boundary(self, boundary: bool) -> None:
        """Whether the next backward ends an accumulation window (only then it communicates)."""
        self.armed = boundary

    # -- backward ------------------------------------------------------------------------------
    def _on_grad_ready(self, unit: Unit, _param) -> None:
        self.dirty.add(unit.index)
        if not self.armed:
            return
        self._queue_end_of_backward()
        self.missing[unit.index] -= 1
        if unit.index not in self.launched:
            self._launch(force=False)

    def _launch_unit(self, unit: Unit) -> None:
        flat = self.flat_grads[unit.index]
        send = self.reduction.before(flat.to(self.reduction.comm_dtype(flat.dtype), copy=True),
                                     self.comm.world_size)
        self.dirty.discard(unit.index)
        self.launched.add(unit.index)
        self.in_flight.append((unit, send, self.comm.all_reduce(send, async_op=True, unit=unit)))
        while len(self.in_flight) > MAX_IN_FLIGHT:
            self._land_oldest()

    def _land_oldest(self) -> None:
        unit, send, handle = self.in_flight.popleft()
        if handle is not None:
            handle.wait()
        averaged = self.reduction.after(send, self.comm.world_size)
        flat = self.flat_grads[unit.index]
        if averaged.dtype == flat.dtype and unit.index not in self.dirty:
            flat.copy_(averaged)  # the buffer now holds the average; the copy goes
            self.reduced.pop(unit.index, None)
        else:
            # Reduced in a wider dtype (bf16/fp16 gradients), or written again since its launch
            # (then the boundary reduces the buffer anew): keep the reduced copy beside it.
            self.reduced[unit.index] = averaged

    def _land_all(self) -> None:
        while self.in_flight:
            self._land_oldest()

    def _end_of_backward(self) -> None:
        self._launch(force=True)
        self._land_all()
        self._clear_backward()

    def _clear_backward(self) -> None:
        self.missing = {u.index: len(u.slots) for u in self.units}
        self.launched: set[int] = set()
        self.next_launch = 0
        self.callback_queued = False

    # -- interface -----------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """All-reduce (in the communication dtype) and average what backward has not reduced."""
        self._land_all()
        n = self.comm.world_size
        todo = [u for u in self.units if u.index in self.dirty]
        sends = [self.reduction.for_reduce(self.flat_grads[u.index], n) for u in todo]
        handles = [self.comm.all_reduce(send, async_op=True, unit=u)
                   for u, send in zip(todo, sends)]
        wait_all(handles)
        for unit, send in zip(todo, sends):
            self.reduced[unit.index] = self.reduction.after(send, n)
        self.dirty.clear()

    def grad_shard(self, unit) -> torch.Tensor:
        """The unit's averaged gradient (in the communication dtype) once reduced."""
        reduced = self.reduced.get(unit.index)
        return reduced if reduced is not None else super().grad_shard(unit)

    def gather_params(self) -> None:
        """Nothing to gather: every rank stepped the full parameters."""

    def zero_grad(self) -> None:
        """Clear the full buffers and forget the reduced copies."""
        self.reduced.clear()
        self.dirty = {u.index for u in self.units}
        super().zero_grad()

    def reset(self) -> None:
        """Drop a backward cut short: wait for its all-reduces, clear everything."""
        for _, _, handle in self.in_flight:
            if handle is not None:
                handle.wait()
        self.in_flight.clear()
        self._clear_backward()
        self.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Full gradient buffers, plus reduced copies (between backward and step)."""
        flats = {t.data_ptr() for t in self.flat_grads}
        return super().grad_tensors() + [t for t in self.reduced.values()
                                         if t.data_ptr() not in flats]
