"""ZeRO stage 0: plain data parallelism on the zeroshard layout (our DDP baseline).

Communication plan, per optimizer step:
  1. backward: autograd accumulates each parameter's gradient in place into its unit's full flat
     gradient buffer (micro-steps accumulate there too). In the backward of the accumulation
     boundary (`expect_boundary`, told by the engine; every backward when nobody says), as DDP
     does with its buckets: as soon as a unit's gradients are all in (post-accumulate-grad
     hooks), and every unit before it in the layout's gradient-ready order has been launched, it
     is all-reduced asynchronously while backward goes on. When the gradients are already in the
     communication dtype (fp32, `reduction.py`) the all-reduce runs in place on the gradient
     buffer itself, as DDP's `gradient_as_bucket_view` does: no copy in, no copy back, no
     second buffer, so nothing bounds how many are in flight. The units are DDP's buckets
     (`layout.ddp_bucket_caps`: 1 MiB first, then 25 MiB), and the first gradient of each
     parameter is multiplied by 1/N as it is copied into its buffer (where 1/N is exact), as DDP
     does on its way into a bucket: no pass divides the sum afterwards. Otherwise (fp16/bf16
     gradients summed in fp32) a copy in the communication dtype is reduced, at most
     MAX_IN_FLIGHT of them at once (policy.py), each kept beside its buffer once averaged.
     A gradient that arrives for a unit already reduced (a parameter used again by a reentrant
     checkpoint, or another backward before the step) first lands that unit's all-reduce (a
     pre-accumulation hook, so autograd never writes a buffer a collective is reading), sets the
     average reduced so far aside and restarts the buffer from zero; the boundary reduces the
     new gradients and adds the two, so every reduction mode stays exact.
     End of backward (an autograd callback): units never completed (unused parameters) are
     launched in order, and every all-reduce is waited for (and what was not scaled on its way
     in divided by N).
  2. accumulation boundary: units written since their all-reduce was launched (or that no
     backward reduced: overlap off, world of one) are all-reduced now, in layout order.
     Ring cost either way: 2 x Psi x (N-1)/N elements of the communication dtype per rank.
     The last all-reduce of each round (the last unit's, whose buffer has room for it) also
     carries every rank's step counts (`step_check.py`): a rank that skipped a step or a backward
     is caught at the step that follows, not at exit; and after them whether any rank's loss in
     the window was inf/nan (`step_check.LossCheck`), the step's inf/nan guard when it needs no
     gradient norm (no clipping or loss scaling: no pass over the gradients that DDP does not make).
  3. step: every rank steps the whole of every unit (optimizer state is fully replicated); the
     parameters are views into the flat buffers, so they are current with no further collective.
"""

from __future__ import annotations

from functools import partial

import torch

from ..dist import Comm
from .layout import Unit
from .policy import MAX_IN_FLIGHT, FullGradients, StagePolicy
from .spec import StageSpec
from .step_check import CarriedChecks
from ..dist.streams import Streams
from .training_state import LaunchOrder, StepState, TrainingState, hook_outputs


class Stage0(StagePolicy):
    """Full params, full grads, full optimizer state; all-reduce overlapped with backward."""

    stage = 0
    shards_optimizer = False

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *,
                 module: torch.nn.Module | None, streams: Streams, syncs=None, early=None):
        """Full gradient buffers (each with room for the carried checks after it), and the hooks
        that overlap the all-reduce with backward (`syncs` / `early` unused at stage 0)."""
        super().__init__(units, comm, spec, module=module, streams=streams)
        self.checks = CarriedChecks(comm.world_size, comm.rank)  # room after each buffer
        self.grads = FullGradients(units, spec.keeps_gradients, extra=self.checks.numel())
        self.generation = 0  # counts gradient writes: the buffers changed since a step
        self.state = StepState(self._end_of_backward, self.stage)
        self.order = LaunchOrder(units)
        self.reduced: dict[int, torch.Tensor] = {}  # averaged copies in a wider dtype
        self.earlier: dict[int, torch.Tensor] = {}  # averages set aside (see the module docstring)
        self.averaged: set[int] = set()  # buffers that hold (or are becoming) their average
        self.dirty = {u.index for u in units}  # buffers changed since their reduction
        self.armed = True  # whether the coming backward communicates (the boundary's does)
        self.in_flight: dict[int, tuple] = {}  # unit index -> (unit, send, handle)
        # Parameters whose gradient views hold stale values since zero_grad (`.grad` is None
        # until autograd's first gradient is copied in): unit index -> slot indices.
        self.stale: dict[int, set[int]] = {}
        self.overlapping = self.overlap and module is not None and comm.world_size > 1
        # Averaging on the way in (`_grad_hook`): the factor per unit (None: divided after the
        # sum), and the slots whose gradients were scaled by it since zero_grad.
        self.scale_in = {u.index: scale_in(self.reduction, u, comm.world_size)
                         if self.overlapping else None for u in units}
        self.scaled: dict[int, set[int]] = {u.index: set() for u in units}
        self.zeroed: dict[int, set[int]] = {}  # stale slots zeroed when their unit launched
        self.grads.hook(self.hooks, self._grad_hook)
        if not (spec.keeps_gradients and comm.world_size > 1):
            return
        for unit in units:
            for i, slot in enumerate(unit.slots):
                self.hooks.append(slot.param.register_hook(partial(self._before_grad, unit, i)))
        if self.overlapping:
            self.hooks.append(module.register_forward_hook(
                lambda _m, _i, out: hook_outputs(out, self._begin_backward)))

    def _grad_hook(self, unit: Unit, slot: int, view: torch.Tensor):
        """After autograd accumulated a gradient: the first one since zero_grad is copied into
        the view (no longer stale), times 1/N in the backward that communicates (`scale_in`, as
        DDP averages on its way into a bucket; what is added to a scaled slot later is scaled in
        `_before_grad`, unscaled slots are divided after the sum); the unit is launched once
        complete (overlap)."""
        index = unit.index
        overlapping = self.overlapping
        factor = self.scale_in[index]
        scaled = self.scaled[index]

        def hook(param) -> None:
            self.generation += 1
            grad = param.grad
            if grad is not None and grad.data_ptr() != view.data_ptr():
                if factor is not None and self.armed:
                    torch.mul(grad, factor, out=view)
                    scaled.add(slot)
                else:
                    view.copy_(grad)
                    scaled.discard(slot)
                param.grad = view
                stale = self.stale.get(index)
                if stale:
                    stale.discard(slot)
            if overlapping and self.armed:
                self._on_grad_ready(unit)

        return hook

    def expect_boundary(self, boundary: bool) -> None:
        """Whether the next backward ends an accumulation window (only then it communicates)."""
        self.armed = boundary

    def note_loss(self, loss: torch.Tensor | None) -> None:
        """A backward of `loss` begins (None: one whose loss is not seen), for `LossCheck`."""
        self.checks.loss.note(loss)

    # -- backward ------------------------------------------------------------------------------
    def _begin_backward(self, _grad=None) -> None:
        if self.armed:
            self.state.begin_backward()

    def _before_grad(self, unit: Unit, slot: int, grad: torch.Tensor) -> torch.Tensor | None:
        """Before autograd adds into `unit`'s buffer: land its all-reduce, set an average aside;
        a gradient added to a slot scaled by 1/N is scaled too (returned)."""
        index = unit.index
        if index in self.in_flight:
            self._land(index)
        self.dirty.add(index)  # (also without overlap: the boundary must reduce it)
        if index in self.averaged:
            self.averaged.discard(index)
            flat = self.grads.flats[index]
            if index in self.earlier:
                self.earlier[index].add_(flat)
            else:
                self.earlier[index] = flat.clone()
            flat.zero_()
            if self.scale_in[index] is not None:  # zeros are scaled: what comes is scaled too
                self.scaled[index].update(range(len(unit.slots)))
        if slot in self.scaled[index] and unit.slots[slot].param.grad is not None:
            return grad * self.scale_in[index]  # added to the view, not copied in by the hook
        return None

    def _clear_stale(self, unit: Unit) -> None:
        """Zero (and re-attach) the views of parameters that got no gradient since zero_grad."""
        zeroed = self.zeroed[unit.index] = self.stale.pop(unit.index, set())
        for i in zeroed:
            unit.slots[i].param.grad = self.grads.view(unit, i).zero_()

    def _on_grad_ready(self, unit: Unit) -> None:
        """One more gradient of `unit` is in: launch what became ready (once it is complete)."""
        if self.state.state is not TrainingState.BACKWARD:
            self.state.begin_backward()
        order = self.order
        order.missing[unit.index] -= 1
        if order.missing[unit.index] <= 0 and unit.index not in order.launched:
            for ready in order.ready():
                self._launch_unit(ready)

    def _launch_unit(self, unit: Unit, carries: bool | None = None) -> None:
        """All-reduce `unit` asynchronously (in place when it can); `carries`: with the step counts
        (default: when it is the last unit, the last one a backward launches)."""
        if carries is None:
            carries = unit.index == self.units[-1].index
        self._clear_stale(unit)
        n = self.comm.world_size
        flat = self.grads.flats[unit.index]
        dtype = self.reduction.comm_dtype(flat.dtype)
        extra = self.checks.numel() if carries else 0
        if dtype == flat.dtype:
            # The buffer's own storage runs on past it: room for the counts.
            send = flat.as_strided((unit.padded_numel + extra,), (1,))
        else:
            send = torch.empty(unit.padded_numel + extra, dtype=dtype, device=flat.device)
            send[:unit.padded_numel].copy_(flat)
        self.reduction.before(send[:unit.padded_numel], n)
        if extra:
            self.checks.write(send[unit.padded_numel:])
        self.dirty.discard(unit.index)
        self.order.launched.add(unit.index)
        if send.data_ptr() == flat.data_ptr():
            self.averaged.add(unit.index)
        handle = self.comm.all_reduce(send, async_op=True, unit=unit, checked=extra)
        self.in_flight[unit.index] = (unit, send, handle)
        copies = [i for i, entry in self.in_flight.items() if entry[1].data_ptr() !=
                  self.grads.flats[i].data_ptr()]
        if len(copies) > MAX_IN_FLIGHT:  # copies cost memory; in-place ones cost nothing
            self._land(copies[0])

    def _land(self, index: int) -> None:
        """Wait for unit `index`'s all-reduce and turn its sum into the average."""
        unit, send, handle = self.in_flight.pop(index)
        if handle is not None:
            handle.wait()
        if send.numel() > unit.padded_numel:
            self.checks.land(send[unit.padded_numel:])
        in_place = send.data_ptr() == self.grads.flats[index].data_ptr()
        averaged = average(self.reduction, unit, send[:unit.padded_numel], self.comm.world_size,
                           self.scaled[index], self.zeroed.get(index, ()), in_place)
        if not in_place:
            self.reduced[index] = averaged  # a wider dtype (bf16/fp16 gradients)

    def _land_all(self) -> None:
        for index in list(self.in_flight):
            self._land(index)

    def _end_of_backward(self) -> None:
        for unit in self.order.ready(force=True):
            self._launch_unit(unit)
        self._land_all()
        self.order.clear()

    # -- interface -----------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """All-reduce (in the communication dtype) and average what backward has not reduced."""
        self.state.expect(TrainingState.IDLE, what="the optimizer step")
        self._land_all()
        todo = [u for u in self.units if u.index in self.dirty]
        for i, unit in enumerate(todo):
            self._launch_unit(unit, carries=i == len(todo) - 1)
        self._land_all()
        self.dirty.clear()
        for index, earlier in self.earlier.items():  # set aside in place: the buffer's dtype
            self.grads.flats[index].add_(earlier)
        self.earlier.clear()

    def received_counts(self) -> torch.Tensor | None:
        """Every rank's step counts from this step's last all-reduce (`step_check.py`), or None."""
        return self.checks.counts

    def loss_verdict(self) -> torch.Tensor | None:
        """Whether any rank's loss in the window was inf/nan (`LossCheck.verdict`), while the
        gradients the step reads are the buffers themselves; else None."""
        return None if self.reduced else self.checks.loss.verdict()

    def grad_token(self) -> int:
        """Changes whenever a gradient is written into the buffers."""
        return self.generation

    def grad_shard(self, unit) -> torch.Tensor:
        """The unit's averaged gradient (in the communication dtype) once reduced."""
        reduced = self.reduced.get(unit.index)
        return reduced if reduced is not None else self.grads.flats[unit.index]

    def gather_params(self) -> None:
        """Nothing to gather: every rank stepped the full parameters."""

    def zero_grad(self) -> None:
        """Clear the gradients and forget the reduced copies and counts. The buffers are not
        zeroed: each parameter's `.grad` is let go, so that autograd's next gradient is copied
        into its view (`reattach_hook`) instead of added to zeros, one pass over the gradients
        fewer; views that get no gradient are zeroed before their unit is reduced. A backward
        cut short (an error inside it) is dropped first."""
        if self.state.in_backward:
            self.reset()
            return
        self.reduced.clear()
        self.earlier.clear()
        self.averaged.clear()
        for scaled in self.scaled.values():
            scaled.clear()
        self.zeroed.clear()
        self.checks.zero_grad()
        self.dirty = {u.index for u in self.units}
        for unit in self.units if self.keeps_gradients else []:
            self.stale[unit.index] = set(range(len(unit.slots)))
            for slot in unit.slots:
                slot.param.grad = None

    def reset(self) -> None:
        """Drop a backward cut short: wait for its all-reduces, clear everything."""
        for _, _, handle in self.in_flight.values():
            if handle is not None:
                handle.wait()
        self.in_flight.clear()
        self.order.clear()
        self.state.reset()
        self.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Full gradient buffers, plus reduced copies and set-aside averages (between backward
        and step)."""
        flats = {t.data_ptr() for t in self.grads.flats}
        extra = [*self.reduced.values(), *self.earlier.values()]
        return list(self.grads.flats) + [t for t in extra if t.data_ptr() not in flats]


def scale_in(reduction, unit: Unit, world_size: int) -> float | None:
    """The factor that averages `unit`'s gradients as they are copied in, where backward reduces
    them in place and multiplying by it is exact (no half-scaled local gradient is ever seen
    after the reduction); None: the sum is divided after it."""
    if reduction.pre_factor(world_size) != 1.0 or reduction.comm_dtype(unit.dtype) != unit.dtype:
        return None
    return reduction.exact_post_factor(world_size)


def average(reduction, unit: Unit, summed: torch.Tensor, world_size: int, scaled, zeroed,
            in_place: bool) -> torch.Tensor:
    """`unit`'s average from its all-reduced sum: only slots not scaled by 1/N on their way in
    (`scaled`: slot indices) still need dividing (the whole buffer when none was; `zeroed` stale
    slots need nothing either way). `in_place`: `summed` is the gradient buffer itself."""
    if scaled and not in_place:
        raise AssertionError(f"unit {unit.index}: gradients scaled on their way into a buffer "
                             "that was reduced through a copy")
    if not scaled:
        return reduction.after(summed, world_size)
    for i, slot in enumerate(unit.slots):
        if i not in scaled and i not in zeroed:
            reduction.after(summed[slot.offset:slot.offset + slot.numel], world_size)
    return summed
