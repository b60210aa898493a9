"""ZeRO stage 3: parameters, gradients and optimizer state all sharded; units gathered on demand.

Units are module subtrees (`partition.py`): each keeps only this rank's 1/N shard between uses
(the parameter gatherer, `param_gatherer.py`, owns which units are whole and the gathers); small
parameters (below `stage3_param_persistence_threshold` elements) stay whole on every rank and
follow stage 2. Gradients go through the gradient reducer (`grad_reducer.py`), as at stage 2.
This policy holds the two and decides, from its hooks and its training state
(`training_state.py`), when each unit is gathered, released and reduced.

Communication plan, per micro-step (each collective names its unit to the desync watchdog,
`dist/watchdog.py`, which costs nothing unless a collective gets stuck):
  1. forward: a unit module's pre-hook all-gathers the units it needs (`unshard`) and prefetches
     the next ones in the recorded order (`schedule.py`); its post-hook frees them (`reshard`)
     unless they are needed again soon (`stage3_max_reuse_distance`). Parameters outside the
     blocks are gathered the same way around the forward of the module holding them (embedding,
     final norm, head); only the root model's own parameters stay gathered for the whole forward.
     Ring cost: Psi x (N-1)/N elements per rank (a tied weight once per module using it).
  2. backward: a hook on each unit module's outputs gathers its units again just before autograd
     reaches the module (and prefetches in the recorded backward order); a unit a module only
     borrows (a tied weight) is freed again once that module's backward reaches its inputs. Ring
     cost: at most Psi x (N-1)/N (less what reuse kept gathered, typically the last block).
  3. as each unit's gradients complete (post-accumulate-grad hooks), its gradient buffer is
     reduce-scattered in place, this rank's slice is added (divided by N) into its persistent
     gradient shard, and the unit is freed. Ring cost: Psi x (N-1)/N. End of backward: units
     with unused parameters are reduce-scattered with zeros, everything still gathered is freed.
  4. step (accumulation boundary): rank r steps only its shards. Persistent parameters are then
     all-gathered as at stage 2; sharded units need nothing (their next use gathers them).
Total per micro-step: 3 x Psi x (N-1)/N, as in the ZeRO paper.
Evaluation (a forward no backward follows) frees what it gathered when the root's forward returns.
`generate()` (`compat/hf/generation.py`, installed through `extensions.py`), while the model
fits in stage3_max_live_parameters, gathers every unit once (`hold_all`: Psi x (N-1)/N per call,
exact) and frees them on return (on the host, into the pool that training's gathers reuse too);
meanwhile the forward hooks do nothing, so decode steps make no collective and no bookkeeping.

How a unit is gathered and how its gradient is reduced are strategies the policy is built with
(`strategies.py`; composed in `stages.py`): plain, or ZeRO++'s (`zeropp/`), or MiCS's (`mics.py`).
ZeRO++: under `zero_quantized_weights` (qwZ) the gathers of steps 1-2 send
int8 blocks with fp32 scales (about Psi x (1 + 4/256) bytes instead of Psi x element size per
gather); gathers whose weights a user reads (GatheredParameters, `close`) and the persistent
units stay exact. Under `zero_quantized_gradients` (qgZ) with more than one host, step 3 reduces
inside the host in full precision, then across hosts int8-quantized; a unit's cross-host
exchange starts when the next unit's reduction launches and is waited one launch later, so it
runs during the backward of the units after it. Under `zero_hpz_partition_size` (hpZ) the gathers
between a unit's forward and the step stay inside its host (`zeropp/hpz.py`).
"""

from __future__ import annotations

import torch

from ..dist import Comm
from . import extensions
from .grad_reducer import GradReducer, hook_gradients
from .layout import Unit
from .param_gatherer import ParamGatherer
from .partition import Stage3Layout
from .policy_view import Stage3View
from .policy import StagePolicy
from .shard_store import ShardStore
from .spec import StageSpec
from .stage3_hooks import ModuleHooks
from .strategies import Gather, ReduceStrategy
from ..dist.streams import Streams
from .training_state import StepState, TrainingState


class Stage3(StagePolicy):
    """Sharded params, grads and optimizer state; per-unit gather, release and reduce-scatter."""

    stage = 3

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *, layout: Stage3Layout,
                 gather: Gather, reducer: ReduceStrategy, streams: Streams,
                 store: ShardStore | None = None, module: torch.nn.Module | None = None,
                 syncs=None, early=None):
        """`layout`: the units' modules and persistent units (`partition.py`); `store`: where the
        sharded units' shards live (`offload/param.py`; None: on the compute device), made from
        the shards in the compute dtype; `gather` / `reducer`: the strategies (`strategies.py`)."""
        super().__init__(units, comm, spec, module=module, streams=streams)
        self.options = spec.stage3
        self.layout = layout
        #: Units of frozen parameters (`partition.py`): gathered and released like the others,
        #: never reduced, no optimizer state.
        self.frozen = list(layout.frozen)
        self.params = ParamGatherer(units, layout, comm, spec.stage3, gather=gather, store=store,
                                    streams=streams)
        self.grads = GradReducer(units, spec, reducer, rank=comm.rank,
                                 world_size=comm.world_size, streams=streams, syncs=syncs,
                                 early=early, after_launch=self.params.reshard_unit)
        self.state = StepState(self._end_of_backward, self.stage)
        self.deferring = False  # inside the engine's coalesce_grad_reduction()
        # Read by the DeepSpeed surface, generate() and the tests: the gatherer's own objects.
        self.by_index, self.sharded = self.params.by_index, self.params.sharded
        self.store, self.schedule = self.params.store, self.params.schedule
        self.gather, self.reducer = gather, reducer
        self.gathered_pool = self.params.gathered_pool
        self.module_hooks = None
        # What layers above core add (compat/: DeepSpeed's attributes, save guards, generate).
        self.extras = extensions.install(Stage3View(self))
        if spec.keeps_gradients:
            hook_gradients(units, module, self.state, self.grads, self._on_grad_ready, self.hooks)
        if module is None:
            return
        self.module_hooks = ModuleHooks(self.params, self.state, layout, module,
                                        spec.keeps_gradients, self.hooks)

    # -- ownership -----------------------------------------------------------------------------
    def owned_param(self, unit: Unit) -> torch.Tensor:
        """This rank's persistent compute-dtype slice: the shard for sharded units."""
        if unit.index in self.sharded:
            return unit.shard
        return super().owned_param(unit)

    def read_owned(self, unit: Unit) -> torch.Tensor:
        """The owned slice's values, from wherever the shard is placed."""
        if unit.index in self.sharded:
            return self.params.read_owned(unit)
        return super().read_owned(unit)

    def write_owned(self, unit: Unit, values: torch.Tensor) -> None:
        """Set the owned slice (the shard, wherever it is placed) from `values`."""
        if unit.index in self.sharded:
            self.params.write_owned(unit, values)
        else:
            self.gather.forget(unit.index)
            super().write_owned(unit, values)

    def commit(self, unit: Unit) -> None:
        """Copy this rank's slice of a gathered unit's (changed) full buffer into its shard."""
        self.params.commit(unit)

    # -- backward ----------------------------------------------------------------------------------
    def _on_grad_ready(self, unit: Unit, position: int, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is in: a complete unit is reduce-scattered at once and freed
        (while deferring only freed: its gradient waits in its buffer for the flush)."""
        self.state.begin_backward()
        self.grads.arrive(unit, position, param)
        if self.grads.order.complete(unit) and unit.index not in self.grads.order.launched:
            if self.deferring:
                self.params.reshard(unit.index)
            else:
                self.grads.launch(unit)

    def _end_of_backward(self) -> None:
        if not self.deferring:
            for unit in self.units:
                if unit.index not in self.grads.order.launched:
                    self.grads.launch(unit)  # unused parameters: zeros where no gradient came
            self.grads.finish_backward()
        else:  # gradients stay in the unit buffers for the flush
            self.grads.clear_backward()
        self.params.reshard_all()
        self.params.schedule.finish_backward()

    def expect_boundary(self, boundary: bool) -> None:
        """Remember whether this backward ends the accumulation window (for the early step)."""
        self.grads.expect_boundary(boundary)

    def defer_reduction(self) -> None:
        """Stop reducing in each backward: gradients accumulate in the unit buffers."""
        self.deferring = True

    def flush_reduction(self) -> None:
        """Reduce-scatter every unit's buffer once, in layout order (zeros for units no backward
        reached): one collective per unit for all the backwards since `defer_reduction`."""
        self.deferring = False
        if self.keeps_gradients:
            self.grads.launch_ready(force=True)
            self.grads.finish_backward()

    # -- the step ----------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Free anything still gathered (every backward already reduce-scattered its units); the
        reduce strategy finishes the window (MiCS: across the replicas)."""
        self.state.expect(TrainingState.IDLE, TrainingState.FORWARD, what="the optimizer step")
        self.params.reshard_all()
        self.reducer.finish_boundary(self.units, self.grads.grad_shards)

    def grad_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's persistent, already averaged gradient shard."""
        return self.grads.grad_shard(unit)

    def replica_position(self) -> int:
        """This rank's replica of its shard group, from the reduce strategy (MiCS)."""
        return self.reducer.replica_position()

    def gather_params(self) -> None:
        """The persistent units (and pinned ones) made current; the rest wait for their use."""
        self.params.after_step()

    def zero_grad(self) -> None:
        """Clear the gradient shards (and drop a backward that was cut short)."""
        if self.state.in_backward:
            self.reset()
        self.grads.zero()

    def reset(self) -> None:
        """Drop a backward cut short and free every unit no GatheredParameters context pins."""
        self.params.reset()
        self.grads.reset()
        self.state.reset()

    # -- GatheredParameters, generate, empty_partition_cache ---------------------------------------
    def pin(self, indices) -> None:
        """Gather the listed units and keep them gathered until `unpin` (GatheredParameters)."""
        self.params.pin(indices)

    def unpin(self, indices, detach: bool = True) -> None:
        """Undo one `pin`; units no module is running are freed (`detach`: see Unit.release)."""
        self.params.unpin(indices, detach)

    def hold_all(self):
        """Every sharded unit gathered for the block, the forward hooks stepping aside
        (generate); a context manager."""
        self.state.expect(TrainingState.IDLE, TrainingState.FORWARD, what="generate / hold_all")
        return self.params.hold_all()

    def empty_cache(self) -> None:
        """Free every gathered unit no module runs and no context pins, and spare pool blocks."""
        self.params.empty_cache()

    # -- for the memory ledger -------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        """Parameter storage held now: shards, plus full buffers of gathered units."""
        return self.params.param_tensors()

    def placed_param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Offloaded shards under their placement; persistent and gathered units on the device."""
        return self.params.placed_param_tensors()

    def nvme_bytes(self) -> int:
        """Bytes of parameter swap files."""
        return self.store.nvme_bytes()

    def grad_tensors(self) -> list[torch.Tensor]:
        """The persistent gradient shards (unit buffers are reported under "buffers")."""
        return self.grads.grad_tensors()

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Gradient buffers, device copies of offloaded shards (read ahead) and spare gathered-unit
        memory kept in the pool."""
        return self.grads.buffer_tensors() + self.params.buffer_tensors()

    def offload_buffer_tensors(self) -> list[torch.Tensor]:
        """Staging buffers of the parameter store and gradient landing buffers (CPU memory)."""
        return self.store.buffers() + self.grads.landing_tensors()

    def drain(self) -> None:
        """Finish parameter writes in flight, ignoring failures (after one was reported)."""
        self.store.drain()

    def close(self, keep_parameters: bool = True) -> None:
        """Remove hooks and (unless `keep_parameters` is false) leave every unit gathered, so the
        module works on its own again; without it the parameters stay empty (no full model in
        memory, e.g. one that fits only because its shards were on NVMe)."""
        super().close()
        self.extras.remove()
        if self.module_hooks is not None:
            self.module_hooks.close()
        try:
            self.params.close(keep_parameters)
        finally:
            self.reducer.close()
