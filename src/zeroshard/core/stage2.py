"""ZeRO stage 2: gradients and optimizer state sharded; reduce-scatter during backward.

Communication plan, per micro-step and per optimizer step:
  1. backward: when a parameter's gradient is ready (post-accumulate-grad hook) it is copied into a
     full-size buffer of its unit, in the communication dtype, and the parameter's own `.grad` is
     dropped (the gradient reducer, `grad_reducer.py`, owns the buffers and their recycling).
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

On an accelerator each landing runs on the side stream "reduce" (`grad_reducer.py` says how).
  5. all-gather every unit's updated shards into the full flat parameter buffer, in place.
     Ring cost: Psi x (N-1)/N elements per rank.
"""

from __future__ import annotations

import torch

from ..dist import Comm
from .grad_reducer import GradReducer, hook_gradients
from .layout import Unit
from .policy import StagePolicy
from .spec import StageSpec
from .strategies import Reduce
from ..dist.streams import Streams
from .training_state import StepState, TrainingState


class Stage2(StagePolicy):
    """Full params; gradient and optimizer shards; reduce-scatter per unit during backward."""

    stage = 2

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *,
                 module: torch.nn.Module | None, streams: Streams, syncs=None, early=None):
        """The gradient reducer over a plain reduce-scatter, and a hook on every parameter.

        `syncs`: the optimizer's counter of host synchronization points (`dist/hostsync.py`);
        `early`: under optimizer offload, the per-unit CPU step (`offload/early.py`) handed each
        gradient shard as it becomes final in a boundary backward, or None."""
        super().__init__(units, comm, spec, module=module, streams=streams)
        self.grads = GradReducer(units, spec, Reduce(comm), rank=comm.rank,
                                 world_size=comm.world_size, streams=streams, syncs=syncs,
                                 early=early)
        self.state = StepState(self._end_of_backward, self.stage)
        self.deferring = False  # inside the engine's coalesce_grad_reduction()
        if spec.keeps_gradients:  # else an engine without an optimizer: nothing reduced or hooked
            hook_gradients(units, module, self.state, self.grads, self._on_grad_ready, self.hooks)

    def expect_boundary(self, boundary: bool) -> None:
        """Remember whether this backward ends the accumulation window (for the early step)."""
        self.grads.expect_boundary(boundary)

    def _on_grad_ready(self, unit: Unit, position: int, param: torch.nn.Parameter) -> None:
        self.state.begin_backward()
        self.grads.arrive(unit, position, param)
        if not self.deferring:  # else it accumulates in the unit's buffer until the flush
            self.grads.launch_ready()

    def _end_of_backward(self) -> None:
        if self.deferring:  # the unit buffers keep this backward's gradients for the flush
            self.grads.clear_backward()
            return
        self.grads.launch_ready(force=True)
        self.grads.finish_backward()

    def defer_reduction(self) -> None:
        """Stop reducing in each backward: gradients accumulate in the unit buffers."""
        self.deferring = True

    def flush_reduction(self) -> None:
        """Reduce-scatter every unit's buffer once, in layout order (zeros for units no backward
        reached), as at the end of one backward: one collective per unit for all the backwards."""
        self.deferring = False
        if self.keeps_gradients:
            self.grads.launch_ready(force=True)
            self.grads.finish_backward()

    # -- interface -------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Nothing left to do: every backward already reduce-scattered into the shards."""
        self.state.expect(TrainingState.IDLE, TrainingState.FORWARD, what="the optimizer step")

    def grad_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's persistent, already averaged gradient shard."""
        return self.grads.grad_shard(unit)

    def zero_grad(self) -> None:
        """Clear the gradient shards (and drop a backward that was cut short)."""
        if self.state.in_backward:
            self.reset()
        self.grads.zero()

    def reset(self) -> None:
        """Drop a backward that was cut short (an error inside it) and clear the gradients."""
        self.grads.reset()
        self.state.reset()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient shards (unit buffers are reported under "buffers")."""
        return self.grads.grad_tensors()

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Unit-sized gradient buffers held now: being filled, or pooled for the next backward."""
        return self.grads.buffer_tensors()

    def offload_buffer_tensors(self) -> list[torch.Tensor]:
        """Pinned landing buffers of offloaded gradient slices (accelerator only; CPU memory)."""
        return self.grads.landing_tensors()
