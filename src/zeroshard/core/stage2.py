"""ZeRO stage 2: gradients and optimizer state sharded; reduce-scatter during backward.

Communication plan, per micro-step and per optimizer step:
  1. backward: when a parameter's gradient is ready (post-accumulate-grad hook) it is copied into a
     full-size buffer of its unit, in the communication dtype (`reduction.py`: fp32 for fp16/bf16
     gradients by default, so the cast costs nothing extra), and the parameter's own `.grad` is
     dropped. Buffers of the
     large units are views into a few recycled largest-unit-sized blocks (at most
     MAX_IN_FLIGHT + 1 kept), so a step pays no allocation, page faults or memset (measured at
     ~110 ms/step on a 57 M-parameter model without them); small units allocate their own.
  2. as soon as a unit's gradients are all in, and every unit before it in the layout's
     gradient-ready order has been launched, its buffer is reduce-scattered in place
     (asynchronously, so backward goes on computing): rank r's slice of it becomes the sum over
     ranks, which r adds, divided by N, into its persistent gradient shard (fp32 unless the
     masters are bf16: micro-steps accumulate there); the buffer is recycled. Launching in the layout's
     fixed order keeps the collectives in the same order on every rank even when autograd visits
     units in another order or some parameters get no gradient. Ring cost per micro-step:
     Psi x (N-1)/N elements per rank.
  3. end of backward (an autograd callback): units still incomplete (unused parameters) are
     launched with zeros where gradients are missing, and all reduce-scatters are waited for.
  4. step (accumulation boundary): rank r steps only its shard. Under optimizer offload the
     gradient shards live in CPU memory: each unit's reduced slice is copied there as it lands
     in step 3, while backward goes on.

Streams (`dist/streams.py`; on CPU none of this exists and everything runs in program order): on an
accelerator each landing (the wait for the reduce-scatter, the divide-and-add into the shard, or
under optimizer offload a non-blocking copy into a pinned landing buffer) runs on a side stream
"reduce", after an event of the compute stream; a recycled block is reused by the compute stream
only after the side stream's event, and buffers stay referenced until the end of backward, when
the compute stream waits for the side stream once. Offloaded slices are added into the CPU
shards then, after one host wait for all their copies.
  5. all-gather every unit's updated shards into the full flat parameter buffer, in place.
     Ring cost: Psi x (N-1)/N elements per rank.
"""

from __future__ import annotations

from collections import deque
from functools import partial

import torch
from torch.utils._pytree import tree_leaves

from ..dist.hostmem import host_empty, host_region, host_zeros, to_host
from .layout import Unit
from .policy import MAX_IN_FLIGHT, StagePolicy, eager_hook


class Stage2(StagePolicy):
    """Full params; gradient and optimizer shards; reduce-scatter per unit during backward."""

    stage = 2
    boundary = False  # the engine said the backward running now ends the accumulation window
    clean_backwards = 0  # backwards that ended without late gradients
    saw_late = False  # a gradient reached a unit after it had landed (reentrant checkpoints)
    output_bad = None  # 0-dim device bool: a gradient reaching the model's outputs is inf/nan

    def expect_boundary(self, boundary: bool) -> None:
        """Remember whether this backward ends the accumulation window (for the early step)."""
        self.boundary = boundary

    @eager_hook
    def _hook_outputs(self, module, inputs, output) -> None:
        """As every policy; under the early CPU step also watch the outputs' gradients."""
        super()._hook_outputs(module, inputs, output)
        if self.early is not None and torch.is_grad_enabled():
            for leaf in tree_leaves(output):
                if torch.is_tensor(leaf) and leaf.requires_grad:
                    leaf.register_hook(self._watch_output_grad)

    def _watch_output_grad(self, grad: torch.Tensor) -> None:
        # Checked on the device, never read: `_poison` spreads it through the reduce-scatter.
        bad = ~torch.isfinite(grad).all()
        self.output_bad = bad if self.output_bad is None else self.output_bad | bad

    def _poison(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Early CPU step: when this rank's output gradient was inf/nan, put a NaN into every
        rank's slice of the buffer, so that after the reduce-scatter every rank's shard of every
        unit is non-finite and every unit's CPU step skips it (a NaN loss changes nothing, on any
        rank, as with the step after backward). Finite runs are untouched (a masked fill)."""
        if self.output_bad is not None and unit.shard_numel:
            buffer.view(self.comm.world_size, -1)[:, 0].masked_fill_(self.output_bad, float("nan"))

    def _early_ok(self) -> bool:
        return self.early is not None and self.boundary and self.clean_backwards > 0 \
            and not self.saw_late

    def _attach(self) -> None:
        """Allocate persistent gradient shards and hook every managed parameter."""
        self.grad_shards = {u.index: self._grad_shard_memory(u) for u in self.units}
        self.buffers: dict[int, torch.Tensor] = {}  # unit index -> its full gradient, being filled
        self.filled: dict[int, list[bool]] = {}  # unit index -> which slots hold a gradient
        self.block_numel = {}  # dtype -> numel of the recycled blocks (the largest unit's)
        for unit in self.units:
            dtype = self._comm_dtype(unit)
            self.block_numel[dtype] = max(self.block_numel.get(dtype, 0), unit.padded_numel)
        self.pool: dict[torch.dtype, list[torch.Tensor]] = {}  # free blocks
        # -- accelerator only (side streams, `self.streams`; all empty on CPU) --
        self.block_event: dict[int, object] = {}  # block data_ptr -> side-stream use to wait for
        self.reduce_done = None  # event after the last landing queued on the side stream
        self.keep_alive: list = []  # buffers and handles the side stream may still read
        self.landing: dict[int, torch.Tensor] = {}  # unit index -> pinned buffer (offload)
        self.landed: list[Unit] = []  # offloaded units whose slice is on its way to the host
        self.block_of: dict[int, torch.Tensor] = {}  # unit index -> the block its buffer is in
        self.missing = {u.index: len(u.slots) for u in self.units}
        self.launched: set[int] = set()
        self.next_launch = 0
        self.in_flight = deque()
        self.callback_queued = False
        if not self.keeps_gradients:
            return  # an engine without an optimizer: nothing reduced, nothing hooked
        if self.module is not None:
            self.hooks.append(self.module.register_forward_hook(self._hook_outputs))
        for unit in self.units:
            for position, slot in enumerate(unit.slots):
                slot.param.grad = None
                self.hooks.append(slot.param.register_post_accumulate_grad_hook(
                    partial(self._on_grad_ready, unit, position)))

    def _grad_shard_memory(self, unit: Unit) -> torch.Tensor:
        """A zeroed gradient shard in the accumulation dtype: on the device, or in (pinned on
        CUDA) CPU memory when the optimizer is offloaded, so the step finds its gradients where
        it runs."""
        dtype = self.accum_dtype or unit.dtype
        if not self.keeps_gradients:
            return torch.empty(0, dtype=dtype, device=unit.compute_device)
        if self.grad_place == "device":
            return torch.zeros(unit.shard_numel, dtype=dtype, device=unit.compute_device)
        return host_zeros(unit.shard_numel, dtype, pin=unit.compute_device.type == "cuda")

    def _comm_dtype(self, unit: Unit) -> torch.dtype:
        """dtype of `unit`'s gradient buffer: the one its reduce-scatter sums in."""
        return self.reduction.comm_dtype(unit.dtype)

    # -- backward ------------------------------------------------------------------------------
    def _on_grad_ready(self, unit: Unit, position: int, param: torch.nn.Parameter) -> None:
        self._queue_end_of_backward()
        buffer = self._buffer(unit)
        slot = unit.slots[position]
        target = buffer[slot.offset: slot.offset + slot.numel]
        if self.filled[unit.index][position]:
            target.add_(param.grad.reshape(-1))
        else:
            target.copy_(param.grad.reshape(-1))
            self.filled[unit.index][position] = True
        param.grad = None
        self.missing[unit.index] -= 1
        self._ready(unit)

    def _ready(self, unit: Unit) -> None:
        """A gradient of `unit` arrived: launch whatever the fixed layout order allows (nothing
        while deferring: it accumulates in the unit's buffer until `flush_reduction`)."""
        if not self.deferring:
            self._launch(force=False)

    def _buffer(self, unit: Unit) -> torch.Tensor:
        buffer = self.buffers.get(unit.index)
        if buffer is None:
            dtype = self._comm_dtype(unit)
            if self._pooled(unit):
                free = self.pool.get(dtype)
                block = free.pop() if free else torch.empty(
                    self.block_numel[dtype], dtype=dtype, device=unit.compute_device)
                self.streams.wait(self.block_event.pop(block.data_ptr(), None))
                self.block_of[unit.index] = block
                buffer = block[:unit.padded_numel]
            else:
                buffer = torch.empty(unit.padded_numel, dtype=dtype, device=unit.compute_device)
            self.buffers[unit.index] = buffer
            self.filled[unit.index] = [False] * len(unit.slots)
        return buffer

    def _pooled(self, unit: Unit) -> bool:
        # Small units (e.g. a param group of biases) would pin a whole block all backward long.
        return 2 * unit.padded_numel >= self.block_numel[self._comm_dtype(unit)]

    def _recycle(self, unit: Unit, used_until=None) -> None:
        block = self.block_of.pop(unit.index, None)
        free = self.pool.setdefault(self._comm_dtype(unit), [])
        if block is not None and len(free) <= MAX_IN_FLIGHT:
            if used_until is not None:
                self.block_event[block.data_ptr()] = used_until
            free.append(block)

    def _seal(self, unit: Unit, buffer: torch.Tensor) -> None:
        """Zero what no gradient was written to: padding and parameters unused in this backward."""
        buffer[unit.numel:].zero_()
        for slot, done in zip(unit.slots, self.filled.pop(unit.index)):
            if not done:
                buffer[slot.offset: slot.offset + slot.numel].zero_()

    def _launch_unit(self, unit: Unit) -> None:
        """Reduce-scatter `unit`'s gradient buffer (asynchronously) and bound what is in flight."""
        buffer = self._buffer(unit)
        del self.buffers[unit.index]
        self._seal(unit, buffer)
        self._poison(unit, buffer)
        self.reduction.before(buffer, self.comm.world_size)
        self.launched.add(unit.index)
        handle = self._reduce_scatter(buffer, unit)
        self.in_flight.append((unit, buffer, handle))
        limit = MAX_IN_FLIGHT if self.overlap else 0
        if self.overlap and hasattr(handle, "advance"):
            # A two-step reduction (qgZ: host, then across hosts): the older units' second step
            # starts now and is waited one launch later, so it overlaps one more unit's backward.
            limit += 1
            for _, _, older in list(self.in_flight)[:-1]:
                older.advance()
        while len(self.in_flight) > limit:
            self._land()

    def _reduce_scatter(self, buffer: torch.Tensor, unit: Unit):
        """Start summing `buffer` over the ranks into this rank's slot of it; returns the handle
        (stage 3 under zero_quantized_gradients reduces host by host instead)."""
        return self.comm.reduce_scatter(buffer, async_op=True, unit=unit)

    def _land(self) -> None:
        unit, buffer, handle = self.in_flight.popleft()
        if self.streams.active:
            self._land_on_side_stream(unit, buffer, handle)
            return
        if handle is not None:
            handle.wait()
        reduced = unit.shard_view(buffer, self.comm.rank)
        shard = self.grad_shards[unit.index]
        alpha = 1.0 / self.reduction.post_divisor(self.comm.world_size)
        if self.grad_place == "device":
            shard.add_(reduced, alpha=alpha)
        else:
            with host_region():  # optimizer offload: to host memory as each unit lands
                shard.add_(to_host(reduced), alpha=alpha)
            if self._early_ok():
                self.early.ready(unit, shard)
        self._recycle(unit)

    def _land_on_side_stream(self, unit: Unit, buffer: torch.Tensor, handle) -> None:
        """Accelerator: the landing runs on the "reduce" stream, off the compute stream."""
        early = False
        with self.streams.on("reduce"):
            if handle is not None:
                handle.wait()  # this (side) stream waits for the collective, not the host
            reduced = unit.shard_view(buffer, self.comm.rank)
            if self.grad_place == "device":
                alpha = 1.0 / self.reduction.post_divisor(self.comm.world_size)
                self.grad_shards[unit.index].add_(reduced, alpha=alpha)
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
            alpha = 1.0 / self.reduction.post_divisor(self.comm.world_size)
            self.early.ready(unit, self.grad_shards[unit.index], self.reduce_done,
                             self.landing[unit.index], alpha)
        self.keep_alive.append((buffer, handle))
        self._recycle(unit, self.reduce_done)

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
            alpha = 1.0 / self.reduction.post_divisor(self.comm.world_size)
            with host_region():
                for unit in self.landed:
                    self.grad_shards[unit.index].add_(self.landing[unit.index], alpha=alpha)
            self.landed.clear()
        self.keep_alive.clear()
        self.reduce_done = None

    def _end_of_backward(self) -> None:
        if self.deferring:  # the unit buffers keep this backward's gradients for the flush
            self._clear_backward()
            return
        self._launch(force=True)
        self._finish_backward()

    def flush_reduction(self) -> None:
        """Reduce-scatter every unit's buffer once, in layout order (zeros for units no backward
        reached), as at the end of one backward: one collective per unit for all the backwards."""
        super().flush_reduction()
        if self.keeps_gradients:
            self._launch(force=True)
            self._finish_backward()

    def _finish_backward(self) -> None:
        """Land every reduce-scatter, reduce gradients that came late, reset for the next backward.

        A gradient can arrive after its unit was launched (a parameter used again by a later
        reentrant-checkpoint backward): its buffer is reduced on its own, never carried over.
        """
        while self.in_flight:
            self._land()
        late = [self.units[i].describe() for i in self.buffers]
        stepped = bool(late) and self._early_ok() and self.early.active
        self.saw_late |= bool(late)  # from now on (before these land): no early step
        for index in list(self.buffers):
            self._launch_unit(self.units[index])
        while self.in_flight:
            self._land()
        self._join_side_stream()
        self._clear_backward()
        self.clean_backwards += not late
        if stepped:
            raise RuntimeError(
                f"gradients reached {', '.join(late[:3])} after its shard had been handed to the "
                "CPU optimizer step during this backward (a parameter reused by a later "
                "reentrant checkpoint backward, which no earlier backward showed): this step is "
                "wrong; load the last checkpoint, and set zero_optimization.offload_optimizer."
                "zeroshard_step_in_backward to false for this model")

    def _clear_backward(self) -> None:
        """Nothing pending: every unit waits for all its gradients again."""
        self.missing = {u.index: len(u.slots) for u in self.units}
        self.launched.clear()
        self.next_launch = 0
        self.callback_queued = False
        self.boundary = False
        self.output_bad = None

    # -- interface -------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Nothing left to do: every backward already reduce-scattered into the shards."""

    def grad_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's persistent, already averaged gradient shard."""
        return self.grad_shards[unit.index]

    def zero_grad(self) -> None:
        """Clear the gradient shards."""
        for shard in self.grad_shards.values():
            shard.zero_()

    def reset(self) -> None:
        """Drop a backward that was cut short (an error inside it) and clear the gradients."""
        if self.early is not None:
            self.early.wait()  # it may still read gradient shards
        while self.in_flight:
            unit, _, handle = self.in_flight.popleft()
            if handle is not None:
                handle.wait()
            self._recycle(unit)
        for index in list(self.buffers):
            del self.buffers[index]
            self._recycle(self.units[index])
        if self.reduce_done is not None:
            self.reduce_done.synchronize()  # after an error: nothing is in flight any more
        self.reduce_done = None
        self.keep_alive.clear()
        self.landed.clear()
        self.filled.clear()
        self._clear_backward()
        self.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient shards (unit buffers are reported under "buffers")."""
        return list(self.grad_shards.values())

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Unit-sized gradient buffers held now: being filled, or pooled for the next backward."""
        return list(self.buffers.values()) + list(self.block_of.values()) + \
            [b for free in self.pool.values() for b in free]

    def offload_buffer_tensors(self) -> list[torch.Tensor]:
        """Pinned landing buffers of offloaded gradient slices (accelerator only; CPU memory)."""
        return list(self.landing.values())
