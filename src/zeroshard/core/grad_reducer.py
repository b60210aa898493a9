"""The gradient reducer of stages 2 and 3: unit buffers, their reduce-scatters, and where they land.

A stage hands the reducer each parameter's gradient as autograd finishes it (`arrive`) and says
when a unit may launch (`launch`, or `launch_ready` for the layout's fixed order); the reducer
does the rest:
  1. each gradient is copied into its unit's full buffer in the communication dtype
     (`reduction.py`: fp32 for fp16/bf16 gradients by default, so the cast costs nothing extra)
     and the parameter's own `.grad` is dropped. Buffers of the large units are views into a few
     recycled largest-unit-sized blocks (`BlockPool`), so a step pays no allocation, page faults
     or memset (measured at ~110 ms/step on a 57 M-parameter model without them); small units
     allocate their own.
  2. `launch(unit)`: padding and parameters that got no gradient are zeroed and the buffer is
     reduced through the reduce strategy (`strategies.py`: a reduce-scatter in place, or qgZ's
     two steps, or MiCS's), asynchronously; at most MAX_IN_FLIGHT stay in flight (one more for
     a two-step reduction, whose older handles `advance()` at each launch).
  3. landing: rank r's slice of the buffer, the sum over ranks, is added divided by N into r's
     persistent gradient shard (fp32 unless the masters are bf16: micro-steps accumulate there);
     the buffer goes back to the pool. Under optimizer offload the shards live in CPU memory and
     each landed slice is copied there while backward goes on; the early CPU step
     (`offload/early.py`) is handed each shard as it becomes final in a boundary backward.
  4. `finish_backward`: every reduction is landed; a gradient that arrived after its unit
     launched (a parameter reused by a later reentrant-checkpoint backward) is reduced on its
     own, never carried over.

Streams (`dist/streams.py`; on CPU none of this exists and everything runs in program order): on an
accelerator each landing runs on the side stream "reduce", after an event of the compute stream;
a recycled block is reused by the compute stream only after the side stream's event, and buffers
stay referenced until the end of backward, when the compute stream waits for the side stream
once. Offloaded slices are added into the CPU shards then, after one host wait for their copies.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import torch

from ..dist.hostmem import host_empty, host_region, host_zeros, to_host
from .layout import Unit
from .policy import MAX_IN_FLIGHT, eager_hook
from .spec import StageSpec
from .strategies import Reduce
from ..dist.streams import Streams
from .training_state import LaunchOrder, StepState, hook_outputs


class BlockPool:
    """Recycled largest-unit-sized gradient buffers, one size per communication dtype."""

    def __init__(self, units: list[Unit], comm_dtype, streams: Streams):
        """`comm_dtype(unit)`: the dtype a unit's gradient is reduced in."""
        self.comm_dtype = comm_dtype
        self.streams = streams
        self.block_numel: dict[torch.dtype, int] = {}
        for unit in units:
            dtype = comm_dtype(unit)
            self.block_numel[dtype] = max(self.block_numel.get(dtype, 0), unit.padded_numel)
        self.free: dict[torch.dtype, list[torch.Tensor]] = {}
        self.block_of: dict[int, torch.Tensor] = {}  # unit index -> the block its buffer is in
        self.block_event: dict[int, object] = {}  # block data_ptr -> side-stream use to wait for

    def take(self, unit: Unit) -> torch.Tensor:
        """A (dirty) buffer of `unit.padded_numel` elements for `unit`'s gradient."""
        dtype = self.comm_dtype(unit)
        # Small units (e.g. a param group of biases) would pin a whole block all backward long.
        if 2 * unit.padded_numel < self.block_numel[dtype]:
            return torch.empty(unit.padded_numel, dtype=dtype, device=unit.compute_device)
        free = self.free.get(dtype)
        block = free.pop() if free else torch.empty(
            self.block_numel[dtype], dtype=dtype, device=unit.compute_device)
        self.streams.wait(self.block_event.pop(block.data_ptr(), None))
        self.block_of[unit.index] = block
        return block[:unit.padded_numel]

    def give_back(self, unit: Unit, used_until=None) -> None:
        """`unit`'s buffer is no longer needed (by the compute stream once `used_until` is done)."""
        block = self.block_of.pop(unit.index, None)
        free = self.free.setdefault(self.comm_dtype(unit), [])
        if block is not None and len(free) <= MAX_IN_FLIGHT:
            if used_until is not None:
                self.block_event[block.data_ptr()] = used_until
            free.append(block)

    def tensors(self) -> list[torch.Tensor]:
        """Blocks held now, in use or free (for the memory ledger)."""
        return list(self.block_of.values()) + [b for free in self.free.values() for b in free]


def grad_shard_memory(unit: Unit, spec: StageSpec) -> torch.Tensor:
    """A zeroed gradient shard of `unit` in the accumulation dtype: on the device, or in (pinned on
    CUDA) CPU memory when the optimizer is offloaded, so the step finds its gradients where it
    runs (empty for an engine without an optimizer)."""
    dtype = spec.accum_dtype or unit.dtype
    if not spec.keeps_gradients:
        return torch.empty(0, dtype=dtype, device=unit.compute_device)
    if spec.grad_place == "device":
        return torch.zeros(unit.shard_numel, dtype=dtype, device=unit.compute_device)
    return host_zeros(unit.shard_numel, dtype, pin=unit.compute_device.type == "cuda")


class GradReducer:
    """Stages 2-3: per-unit gradient buffers reduced into this rank's persistent gradient shards."""

    def __init__(self, units: list[Unit], spec: StageSpec, reduce: Reduce, *, rank: int,
                 world_size: int, streams: Streams, syncs=None, early=None, after_launch=None):
        """`reduce`: the strategy a unit's buffer is reduced through; `early`: the per-unit CPU step
        of optimizer offload, or None; `after_launch(unit)`: called once a unit's reduction has
        started (stage 3 frees the unit's parameters there)."""
        self.units = units
        self.reduce = reduce
        self.rank, self.world_size = rank, world_size
        self.overlap = spec.overlap_comm
        self.grad_place = spec.grad_place
        self.reduction = spec.reduction
        self.streams, self.syncs, self.early = streams, syncs, early
        self.after_launch = after_launch
        self.alpha = 1.0 / self.reduction.post_divisor(world_size)
        self.grad_shards = {u.index: grad_shard_memory(u, spec) for u in units}
        self.pool = BlockPool(units, lambda u: self.reduction.comm_dtype(u.dtype), streams)
        self.order = LaunchOrder(units)
        self.buffers: dict[int, torch.Tensor] = {}  # unit index -> its full gradient, being filled
        self.filled: dict[int, list[bool]] = {}  # unit index -> which slots hold a gradient
        self.in_flight = deque()  # (unit, buffer, handle), oldest first
        # -- the early CPU step (optimizer offload) --
        self.boundary = False  # the backward running now ends the accumulation window
        self.clean_backwards = 0  # backwards that ended without late gradients
        self.saw_late = False  # a gradient reached a unit after it had landed
        self.output_bad = None  # 0-dim device bool: an output gradient was inf/nan
        # -- accelerator only (side streams; all empty on CPU) --
        self.reduce_done = None  # event after the last landing queued on the side stream
        self.keep_alive: list = []  # buffers and handles the side stream may still read
        self.landing: dict[int, torch.Tensor] = {}  # unit index -> pinned buffer (offload)
        self.landed: list[Unit] = []  # offloaded units whose slice is on its way to the host

    # -- gradients arriving ------------------------------------------------------------------------
    def arrive(self, unit: Unit, position: int, param: torch.nn.Parameter) -> None:
        """Take `param`'s gradient (slot `position` of `unit`) into the unit's buffer."""
        buffer = self._buffer(unit)
        slot = unit.slots[position]
        target = buffer[slot.offset: slot.offset + slot.numel]
        if self.filled[unit.index][position]:
            target.add_(param.grad.reshape(-1))
        else:
            target.copy_(param.grad.reshape(-1))
            self.filled[unit.index][position] = True
        param.grad = None
        self.order.arrived(unit)

    def _buffer(self, unit: Unit) -> torch.Tensor:
        buffer = self.buffers.get(unit.index)
        if buffer is None:
            buffer = self.buffers[unit.index] = self.pool.take(unit)
            self.filled[unit.index] = [False] * len(unit.slots)
        return buffer

    def expect_boundary(self, boundary: bool) -> None:
        """Whether the backward starting now ends the accumulation window (the early step)."""
        self.boundary = boundary

    def watch_output_grad(self, grad: torch.Tensor) -> None:
        """A gradient of the model's outputs (early CPU step only): checked on the device, never
        read; `_poison` spreads a bad one through the reduce-scatter."""
        bad = ~torch.isfinite(grad).all()
        self.output_bad = bad if self.output_bad is None else self.output_bad | bad

    # -- launching ---------------------------------------------------------------------------------
    def launch_ready(self, force: bool = False) -> None:
        """Launch, in the layout's order, every unit the order allows (all remaining: `force`)."""
        for unit in self.order.ready(force):
            self.launch(unit)

    def launch(self, unit: Unit) -> None:
        """Reduce `unit`'s gradient buffer (asynchronously) and bound what is in flight."""
        buffer = self._buffer(unit)
        del self.buffers[unit.index]
        self._seal(unit, buffer)
        self._poison(unit, buffer)
        self.reduction.before(buffer, self.world_size)
        self.order.launched.add(unit.index)
        handle = self.reduce.start(buffer, unit)
        self.in_flight.append((unit, buffer, handle))
        limit = MAX_IN_FLIGHT if self.overlap else 0
        if self.overlap and handle.steps > 1:
            # A two-step reduction (qgZ: host, then across hosts): the older units' second step
            # starts now and is waited one launch later, so it overlaps one more unit's backward.
            limit += 1
            for _, _, older in list(self.in_flight)[:-1]:
                older.advance()
        while len(self.in_flight) > limit:
            self._land()
        if self.after_launch is not None:
            self.after_launch(unit)

    def _seal(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Zero what no gradient was written to: padding and parameters unused in this backward."""
        buffer[unit.numel:].zero_()
        for slot, done in zip(unit.slots, self.filled.pop(unit.index)):
            if not done:
                buffer[slot.offset: slot.offset + slot.numel].zero_()

    def _poison(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Early CPU step: when this rank's output gradient was inf/nan, put a NaN into every
        rank's slice of the buffer, so that after the reduce-scatter every rank's shard of every
        unit is non-finite and every unit's CPU step skips it (a NaN loss changes nothing, on any
        rank, as with the step after backward). Finite runs are untouched (a masked fill)."""
        if self.output_bad is not None and unit.shard_numel:
            buffer.view(self.world_size, -1)[:, 0].masked_fill_(self.output_bad, float("nan"))

    def _early_ok(self) -> bool:
        return self.early is not None and self.boundary and self.clean_backwards > 0 \
            and not self.saw_late

    # -- landing -----------------------------------------------------------------------------------
    def _land(self) -> None:
        unit, buffer, handle = self.in_flight.popleft()
        if self.streams.active:
            self._land_on_side_stream(unit, buffer, handle)
            return
        handle.wait()
        reduced = unit.shard_view(buffer, self.rank)
        shard = self.grad_shards[unit.index]
        if self.grad_place == "device":
            shard.add_(reduced, alpha=self.alpha)
        else:
            with host_region():  # optimizer offload: to host memory as each unit lands
                shard.add_(to_host(reduced), alpha=self.alpha)
            if self._early_ok():
                self.early.ready(unit, shard)
        self.pool.give_back(unit)

    def _land_on_side_stream(self, unit: Unit, buffer: torch.Tensor, handle) -> None:
        """Accelerator: the landing runs on the "reduce" stream, off the compute stream."""
        early = False
        with self.streams.on("reduce"):
            handle.wait()  # this (side) stream waits for the collective, not the host
            reduced = unit.shard_view(buffer, self.rank)
            if self.grad_place == "device":
                self.grad_shards[unit.index].add_(reduced, alpha=self.alpha)
            else:  # device -> pinned host memory, added into the CPU shard at end of backward
                landing = self.landing.get(unit.index)
                if landing is None:
                    landing = self.landing[unit.index] = host_empty(
                        reduced.numel(), reduced.dtype, pin=True)
                landing.copy_(reduced, non_blocking=True)
                early = self._early_ok()
                if not early:
                    self.landed.append(unit)
        self.reduce_done = self.streams.record(self.streams.stream("reduce"))
        if self.grad_place != "device" and early:  # added and stepped on the CPU step's thread
            self.early.ready(unit, self.grad_shards[unit.index], self.reduce_done,
                             self.landing[unit.index], self.alpha)
        self.keep_alive.append((buffer, handle))
        self.pool.give_back(unit, self.reduce_done)

    def _join_side_stream(self) -> None:
        """End of backward: the compute stream waits for every landing (no host wait), then
        offloaded slices are added into their CPU shards after one host wait for their copies."""
        if self.reduce_done is None:
            return
        self.streams.wait(self.reduce_done)
        if self.landed:
            if self.syncs is not None:
                self.syncs.wait(self.reduce_done, "offload: gradient shards reach host memory")
            else:
                self.reduce_done.synchronize()
            with host_region():
                for unit in self.landed:
                    self.grad_shards[unit.index].add_(self.landing[unit.index], alpha=self.alpha)
            self.landed.clear()
        self.keep_alive.clear()
        self.reduce_done = None

    def finish_backward(self) -> None:
        """Land every reduction, reduce gradients that came late, reset for the next backward.

        A gradient can arrive after its unit was launched (a parameter used again by a later
        reentrant-checkpoint backward): its buffer is reduced on its own, never carried over.
        """
        while self.in_flight:
            self._land()
        late = [self.units[i].describe() for i in self.buffers]
        stepped = bool(late) and self._early_ok() and self.early.active
        self.saw_late |= bool(late)  # from now on (before these land): no early step
        for index in list(self.buffers):
            self.launch(self.units[index])
        while self.in_flight:
            self._land()
        self._join_side_stream()
        self.clear_backward()
        self.clean_backwards += not late
        if stepped:
            raise RuntimeError(
                f"gradients reached {', '.join(late[:3])} after its shard had been handed to the "
                "CPU optimizer step during this backward (a parameter reused by a later "
                "reentrant checkpoint backward, which no earlier backward showed): this step is "
                "wrong; load the last checkpoint, and set zero_optimization.offload_optimizer."
                "zeroshard_step_in_backward to false for this model")

    def clear_backward(self) -> None:
        """Nothing pending: every unit waits for all its gradients again."""
        self.order.clear()
        self.boundary = False
        self.output_bad = None

    # -- between steps -----------------------------------------------------------------------------
    def grad_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's persistent, already averaged gradient shard of `unit`."""
        return self.grad_shards[unit.index]

    def zero(self) -> None:
        """Clear the gradient shards."""
        for shard in self.grad_shards.values():
            shard.zero_()

    def reset(self) -> None:
        """Drop a backward that was cut short (an error inside it) and clear the gradients."""
        if self.early is not None:
            self.early.wait()  # it may still read gradient shards
        while self.in_flight:
            unit, _, handle = self.in_flight.popleft()
            handle.wait()
            self.pool.give_back(unit)
        for index in list(self.buffers):
            del self.buffers[index]
            self.pool.give_back(self.units[index])
        if self.reduce_done is not None:
            self.reduce_done.synchronize()  # after an error: nothing is in flight any more
        self.reduce_done = None
        self.keep_alive.clear()
        self.landed.clear()
        self.filled.clear()
        self.clear_backward()
        self.zero()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient shards (unit buffers are reported under "buffers")."""
        return list(self.grad_shards.values())

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Unit-sized gradient buffers held now: being filled, or pooled for the next backward."""
        return list(self.buffers.values()) + self.pool.tensors()

    def landing_tensors(self) -> list[torch.Tensor]:
        """Pinned landing buffers of offloaded gradient slices (accelerator only; CPU memory)."""
        return list(self.landing.values())


def hook_gradients(units: list[Unit], module, state: StepState, reducer: GradReducer,
                   on_grad_ready, hooks: list) -> None:
    """Stages 2-3: hand every parameter's gradient to `on_grad_ready(unit, position, param)` as
    autograd finishes it (its `.grad` let go: the reducer's buffer takes it), and have the model's
    outputs start the backward in `state` (and, under the early CPU step, be checked for inf/nan
    by `reducer`); the hook handles are appended to `hooks`."""
    if module is not None:
        hooks.append(module.register_forward_hook(_output_hook(state, reducer)))
    for unit in units:
        for position, slot in enumerate(unit.slots):
            slot.param.grad = None
            hooks.append(slot.param.register_post_accumulate_grad_hook(
                partial(on_grad_ready, unit, position)))


def _output_hook(state: StepState, reducer: GradReducer):
    """The forward hook on the model: a hook on its outputs' gradients starts the backward (and
    queues its end; it runs there first, before any reentrant checkpoint starts a nested
    backward, whose end would otherwise flush half-filled units)."""

    @eager_hook
    def hook(_module, _inputs, output) -> None:
        hook_outputs(output, state.begin_backward)
        if reducer.early is not None:
            hook_outputs(output, reducer.watch_output_grad)

    return hook
