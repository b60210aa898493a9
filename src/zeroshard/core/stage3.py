"""ZeRO stage 3: parameters, gradients and optimizer state all sharded; units gathered on demand.

Units are module subtrees (`partition.py`): each keeps only this rank's 1/N shard between uses.
Its full flat buffer object stays but its storage is emptied (the bytes go back to a pool), so
views of it that autograd saved in forward see the data again once it is refilled; meanwhile the
parameters hold empty tensors (real sizes in `ds_shape` / `ds_numel`; names are unchanged). Small parameters (below `stage3_param_persistence_threshold` elements) stay
whole on every rank and follow stage 2.

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
`generate()` (`generation.py`), while the model fits in stage3_max_live_parameters, gathers every
unit once (`hold_all`: Psi x (N-1)/N per call, exact) and frees them on return (on the host,
into the pool that training's gathers reuse too); meanwhile the forward hooks do nothing, so
decode steps make no collective and no bookkeeping.

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

import contextlib

import torch
from torch.utils._pytree import tree_leaves

from ..dist import Comm
from .stage3_reads import ParameterReads
from . import generation
from .guards import guard_pickling, guard_state_dict
from .layout import StoragePool, Unit, ZeroParamStatus, set_status
from .partition import Stage3Layout
from .schedule import Schedule
from .shard_store import ShardStore
from .spec import StageSpec
from .strategies import Gather, Reduce
from .policy import eager_hook as _eager_hook
from .stage2 import Stage2


class Stage3(Stage2):
    """Sharded params, grads and optimizer state; per-unit gather, release and reduce-scatter."""

    stage = 3

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *, layout: Stage3Layout,
                 store: ShardStore | None = None, gather: Gather | None = None,
                 reducer: Reduce | None = None, module: torch.nn.Module | None = None,
                 syncs=None, early=None, streams=None):
        """`layout`: the units' modules and persistent units (`partition.py`); `store`: where the
        sharded units' shards live (`offload/param.py`; None: on the compute device), made from
        the shards in the compute dtype; `gather` / `reducer`: the strategies
        (`strategies.py`; None: plain)."""
        self.layout = layout
        self.gather = gather if gather is not None else Gather(comm)
        self.reducer = reducer if reducer is not None else Reduce(comm)
        self.options = spec.stage3
        #: Units of frozen parameters (`partition.py`): gathered and released like the others,
        #: never reduced, no optimizer state.
        self.frozen = list(layout.frozen)
        self.by_index = {u.index: u for u in [*units, *self.frozen]}
        self.sharded = {i for i in self.by_index if i not in layout.persistent}
        # On CPU, freed 28 MB buffers stay in glibc's heap; CUDA's caching allocator reuses them.
        on_cpu = all(u.compute_device.type == "cpu" for u in units)
        self.gathered_pool = StoragePool() if on_cpu and \
            hasattr(torch.UntypedStorage, "_swap_data_ptr_") else None
        # The sharded units arrive partitioned (materialize.py): only this rank's shards exist.
        self.schedule = Schedule({u.index: u.padded_numel for u in self.by_index.values()},
                                 self.options.max_reuse_distance)
        self.pending: dict[int, object] = {}  # unit index -> in-flight gather handle
        self.active: dict[int, int] = {}  # unit index -> modules running forward that need it
        self.pinned: dict[int, int] = {}  # unit index -> GatheredParameters contexts holding it
        self.holding_all = 0  # `hold_all` blocks running (generate): the forward hooks step aside
        self.live_numel = 0
        self.peak_live_numel = 0
        self.store = store if store is not None else \
            ShardStore([u for u in self.by_index.values() if u.index in self.sharded])
        self.lossy: set[int] = set()  # gathered units holding qwZ-decoded (not exact) weights
        self.reads: ParameterReads | None = None  # made with the hooks (`_attach`)
        super().__init__(units, comm, spec, module=module, syncs=syncs, early=early,
                         streams=streams)

    # -- ownership -----------------------------------------------------------------------------
    def owned_param(self, unit: Unit) -> torch.Tensor:
        """This rank's persistent compute-dtype slice: the shard for sharded units."""
        if unit.index in self.sharded:
            return unit.shard
        return super().owned_param(unit)

    def read_owned(self, unit: Unit) -> torch.Tensor:
        """The owned slice's values, from wherever the shard is placed."""
        if unit.index in self.sharded:
            return self.store.read(unit)
        return super().read_owned(unit)

    def write_owned(self, unit: Unit, values: torch.Tensor) -> None:
        """Set the owned slice (the shard, wherever it is placed) from `values`."""
        self.gather.forget(unit.index)
        if unit.index in self.sharded:
            self.store.write(unit, values)
        else:
            super().write_owned(unit, values)

    def param_tensors(self) -> list[torch.Tensor]:
        """Parameter storage held now: shards, plus full buffers of gathered units."""
        every = self.by_index.values()  # trained and frozen units
        return [u.shard if u.index in self.sharded else u.flat for u in every] + \
            [u.flat for u in every if u.index in self.sharded and u.is_gathered] + \
            self.gather.tensors()

    def placed_param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Offloaded shards under their placement; persistent and gathered units on the device."""
        placed = {self.store.name: self.store.tensors()}
        device = [u.flat for u in self.by_index.values()
                  if u.index not in self.sharded or u.is_gathered]
        placed.setdefault("device", []).extend(device + self.gather.tensors())
        return placed

    def nvme_bytes(self) -> int:
        """Bytes of parameter swap files."""
        return self.store.nvme_bytes()

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Gradient buffers (as stage 2), device copies of offloaded shards (read ahead) and
        spare gathered-unit memory kept in the pool."""
        return super().buffer_tensors() + self.store.device_buffers() + \
            (self.gathered_pool.tensors() if self.gathered_pool else [])

    def drain(self) -> None:
        """Finish parameter writes in flight, ignoring failures (after one was reported)."""
        self.store.drain()

    def offload_buffer_tensors(self) -> list[torch.Tensor]:
        """Staging buffers of the parameter store and gradient landing buffers (CPU memory)."""
        return self.store.buffers() + super().offload_buffer_tensors()

    # -- unshard / reshard -----------------------------------------------------------------------
    def _issue(self, unit: Unit, exact: bool = False) -> None:
        """Start gathering `unit` into its full buffer (no-op if gathered or on its way)."""
        if unit.index in self.pending or unit.is_gathered:
            return
        # Accelerator: the copy-in of an offloaded shard and the collective are queued from the
        # "gather" side stream, so compute queued after this point never waits for them; the
        # compute stream waits only where it needs the unit (`unshard`, through the handle). The
        # full buffer is allocated on the compute stream, which uses it.
        with self.streams.on("gather"):
            source = self.store.source(unit)  # first: a failed NVMe read leaves nothing half-done
        flat = unit.allocate(self.gathered_pool)
        self.live_numel += unit.padded_numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        with self.streams.on("gather"):
            handle = self._gather(flat, source, unit, exact)
        self.pending[unit.index] = _Gather(handle, self.store, unit)

    def _gather(self, flat: torch.Tensor, source: torch.Tensor, unit: Unit, exact: bool):
        """Start filling `flat` through the gather strategy; `exact`: weights a user reads or
        modifies (GatheredParameters, close), never quantized."""
        handle, lossy = self.gather.start(flat, source, unit, exact)
        if lossy:
            self.lossy.add(unit.index)
        return handle

    def unshard(self, indices, exact: bool = False) -> None:
        """Make the listed sharded units whole on this rank (waits for them); `exact`: with the
        exact weights even under qwZ."""
        todo = [i for i in indices if i in self.sharded]
        for index in todo:
            self._issue(self.by_index[index], exact)
        for index in todo:
            handle = self.pending.pop(index, None)
            if handle is not None:
                handle.wait()
            if exact and index in self.lossy:  # gathered quantized before: gather it again
                unit = self.by_index[index]
                self.comm.all_gather(unit.flat, self.store.source(unit), unit=unit)
                self.store.done(unit)
                self.lossy.discard(index)
            set_status(self.by_index[index], ZeroParamStatus.AVAILABLE)

    def reshard(self, index: int, detach: bool = False) -> None:
        """Free unit `index`'s full buffer (keeps pinned units); `detach`: see Unit.release."""
        unit = self.by_index[index]
        if index not in self.sharded or self.pinned.get(index) or not unit.is_gathered:
            return
        handle = self.pending.pop(index, None)
        if handle is not None:
            handle.wait()  # never free storage a collective is still writing
        unit.release(self.gathered_pool, detach=detach)
        self.lossy.discard(index)
        self.gather.released(index)
        self.live_numel -= unit.padded_numel

    def reshard_all(self, skip_running: bool = False) -> None:
        """Free every gathered (unpinned) unit; `skip_running`: not those a running module needs."""
        for index in sorted(self.sharded):
            if not (skip_running and self.active.get(index)):
                self.reshard(index)

    def _prefetch(self) -> None:
        budget = self.options.prefetch_bucket_size
        for index in self.schedule.upcoming():
            unit = self.by_index[index]
            if unit.is_gathered or index in self.pending:
                continue
            if unit.padded_numel > budget or \
                    self.live_numel + unit.padded_numel > self.options.max_live_parameters:
                break
            self._issue(unit)
            budget -= unit.padded_numel
        self.store.read_ahead(self.schedule.upcoming())

    # -- forward -----------------------------------------------------------------------------------
    def _attach(self) -> None:
        """Stage-2 gradient machinery plus gather/release hooks on every unit module."""
        super()._attach()
        for unit in self.units:  # persistent units are whole; sharded ones are released
            if unit.index not in self.sharded:
                set_status(unit, ZeroParamStatus.AVAILABLE)
        self._guard_saving()
        if self.module is not None:
            generation.install(self.module, self)
        # Parameters used outside the modules that gather them are found as they are used.
        self.reads = ParameterReads(self, self.module) if self.module is not None else None
        for module in self.layout.modules:  # needs are looked up at each call: reads add some
            is_root = module is self.module
            self.hooks.append(module.register_forward_pre_hook(
                lambda mod, args, r=is_root: self._pre_forward(mod, r)))
            self.hooks.append(module.register_forward_hook(
                lambda mod, args, kwargs, out, r=is_root:
                self._post_forward(mod, out, (args, kwargs), r), with_kwargs=True))

    def _guard_saving(self) -> None:
        """torch.save of released parameters raises, state_dict() warns (guards.py)."""
        sharded = {id(p) for i in self.sharded for p in self.by_index[i].params()}
        for param in self.module.parameters():
            if id(param) in sharded:
                guard_pickling(param)
        for module in self.module.modules():
            self.hooks.append(guard_state_dict(module))

    @_eager_hook
    def _pre_forward(self, module: torch.nn.Module, is_root: bool) -> None:
        if self.holding_all:
            return  # every unit is gathered and stays so until hold_all ends
        if self.reads is not None:
            self.reads.push(module, is_root)
        needs = self.layout.needs.get(id(module), ())
        in_backward = _in_backward()
        if is_root and not in_backward:
            self.schedule.start_step()
            self.active.clear()
            if self.reads is not None:
                self.reads.adopt(module)  # modules attached after initialize()
        if not needs:  # a module that only marks the forward stack (stage3_reads.py)
            return
        for index in needs:
            self.active[index] = self.active.get(index, 0) + 1
        if not in_backward:
            self.schedule.demand(needs)
        self.unshard(needs)
        if not in_backward:
            self._prefetch()

    @_eager_hook
    def _post_forward(self, module: torch.nn.Module, output, inputs, is_root: bool) -> None:
        if self.holding_all:
            return
        # Read before a returned parameter moves to the caller: this call counted these down.
        needs = self.layout.needs.get(id(module), ())
        leaves = tree_leaves(output)
        if self.reads is not None:
            self.reads.pop(module)
            self.reads.returned(module, leaves)
        borrowed = self.layout.borrowed.get(id(module), ())
        for index in needs:
            self.active[index] = max(0, self.active.get(index, 0) - 1)
        if _in_backward():
            return  # activation-checkpoint recompute: the unit's backward follows at once
        if not needs and not is_root:
            return
        grad_outputs = [t for t in leaves if torch.is_tensor(t) and t.requires_grad] \
            if torch.is_grad_enabled() else []
        wants_backward = bool(grad_outputs)
        fired = [False]  # one regather per forward call, whichever output's gradient comes first
        for leaf in grad_outputs:
            leaf.register_hook(lambda grad, n=needs, f=fired: self._pre_backward(n, f))
        if borrowed and wants_backward:
            # A borrowed unit (a tied weight: the head using the embedding's) gets its gradient
            # only when its owner's backward is done too; free it once this module's backward
            # has reached the inputs instead of holding it through the whole backward.
            done = [False]
            for leaf in tree_leaves(inputs):
                if torch.is_tensor(leaf) and leaf.requires_grad:
                    leaf.register_hook(lambda grad, b=borrowed, d=done: self._post_backward(b, d))
        for index in needs:
            if self.active.get(index):
                continue  # an enclosing module (e.g. one sharing a tied weight) still runs
            if wants_backward and self.schedule.reuse_soon(index) and \
                    self.live_numel <= self.options.max_live_parameters:
                continue
            self._release_after_forward(index, wants_backward)
        if is_root and not wants_backward:
            # No backward follows this forward (evaluation, generation): nothing it gathered or
            # prefetched stays beyond the persistent units and what GatheredParameters pins.
            self.reshard_all()

    def _release_after_forward(self, index: int, wants_backward: bool) -> None:
        """A unit's forward use is over: free it, after the gather strategy kept what makes its
        backward gather cheaper (hpZ's secondary shard). An engine without an optimizer never
        steps, so it would never drop them: it keeps none."""
        unit = self.by_index[index]
        if self.keeps_gradients and wants_backward and index in self.sharded and \
                unit.is_gathered and index not in self.pending and not self.pinned.get(index):
            self.gather.keep(unit, index in self.lossy)
        self.reshard(index)

    # -- backward ----------------------------------------------------------------------------------
    @_eager_hook
    def _pre_backward(self, needs: list[int], fired: list[bool]) -> None:
        self._queue_end_of_backward()
        if fired[0]:
            return
        fired[0] = True
        self.schedule.demand(needs)
        self.unshard(needs)
        self._prefetch()

    @_eager_hook
    def _post_backward(self, borrowed: list[int], done: list[bool]) -> None:
        """A module's backward reached its inputs: free the units it only borrowed (their
        gradients are accumulated later, after their owner's pre-backward gathers them again)
        unless they are needed again soon."""
        if done[0]:
            return
        done[0] = True
        for index in borrowed:
            if self.schedule.reuse_soon(index) and \
                    self.live_numel <= self.options.max_live_parameters:
                continue
            self.reshard(index)

    def _ready(self, unit: Unit) -> None:
        """Reduce-scatter a unit as soon as all its gradients are in, then free it (while
        deferring, only free it: its gradient waits in its buffer for `flush_reduction`)."""
        if self.missing[unit.index] <= 0 and unit.index not in self.launched:
            if self.deferring:
                self.reshard(unit.index)
            else:
                self._launch_unit(unit)

    def _launch_unit(self, unit: Unit) -> None:
        super()._launch_unit(unit)
        self.reshard(unit.index)

    def _reduce_scatter(self, buffer: torch.Tensor, unit: Unit):
        """Through the reduce strategy (plain, or qgZ across hosts)."""
        return self.reducer.start(buffer, unit)

    def _end_of_backward(self) -> None:
        if self.deferring:  # gradients stay in the unit buffers for the flush
            self._clear_backward()
            self.reshard_all()
            self.schedule.finish_backward()
            return
        for unit in self.units:
            if unit.index not in self.launched:
                self._launch_unit(unit)  # unused parameters: zeros where no gradient came
        self._finish_backward()
        self.reshard_all()
        self.schedule.finish_backward()

    # -- interface -------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Free anything still gathered (every backward already reduce-scattered its units); the
        reduce strategy finishes the window (MiCS: across the replicas)."""
        self.reshard_all()
        self.reducer.finish_boundary(self.units, self.grad_shards)

    def gather_params(self) -> None:
        """All-gather the persistent units (and pinned ones); the rest wait for their next use.
        What the gather strategy kept of the old weights is dropped first (its memory goes back)."""
        self.gather.forget()
        self.store.flush()  # updated shards written back (NVMe) before anyone reads them
        for index in sorted(self.layout.persistent):
            unit = self.by_index[index]
            lo, hi = unit.shard_bounds(self.comm.rank)
            self.comm.all_gather(unit.flat, unit.flat[lo:hi], unit=unit)
        for index in sorted(i for i, n in self.pinned.items() if n):
            # A model gathered for inference (GatheredParameters) sees the updated weights.
            unit = self.by_index[index]
            self.comm.all_gather(unit.flat, self.store.source(unit), unit=unit)
            self.store.done(unit)
            set_status(unit, ZeroParamStatus.AVAILABLE)

    def reset(self) -> None:
        """As stage 2, and free every gathered unit that no GatheredParameters context pins."""
        for index in list(self.pending):
            self.pending.pop(index).wait()
        self.active.clear()
        super().reset()
        self.reshard_all()
        self.gather.forget()

    def pin(self, indices) -> None:
        """Gather the listed units and keep them gathered until `unpin` (GatheredParameters)."""
        indices = sorted(i for i in set(indices) if i in self.sharded)
        for index in indices:
            self.pinned[index] = self.pinned.get(index, 0) + 1
        self.unshard(indices, exact=True)

    @contextlib.contextmanager
    def hold_all(self):
        """Every sharded unit gathered (exact) for the block and released after it; meanwhile the
        forward hooks do nothing (generate: one gather per call, no bookkeeping per token)."""
        indices = sorted(self.sharded)
        try:
            self.pin(indices)
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.unpin(indices)  # a gather that failed part-way leaves nothing pinned
            raise
        self.holding_all += 1
        try:
            yield
        finally:
            self.holding_all -= 1
            # No user code kept views of these buffers: their bytes go back to the pool, so the
            # next call (and the next training step) reuses them instead of touching new memory.
            self.unpin(indices, detach=False)

    def unpin(self, indices, detach: bool = True) -> None:
        """Undo one `pin`; units no module is running are freed (`detach`: see Unit.release)."""
        for index in sorted(i for i in set(indices) if i in self.sharded):
            self.pinned[index] = max(0, self.pinned.get(index, 0) - 1)
            if not self.active.get(index):
                self.reshard(index, detach=detach)

    def empty_cache(self) -> None:
        """Free every gathered unit that no module runs and no context pins, and the pool's
        spare blocks (`engine.empty_partition_cache`)."""
        self.reshard_all(skip_running=True)
        if self.gathered_pool is not None:
            self.gathered_pool.clear()

    def commit(self, unit: Unit) -> None:
        """Copy this rank's slice of a gathered unit's (changed) full buffer into its shard."""
        self.gather.forget(unit.index)
        if unit.index in self.sharded and unit.is_gathered:
            self.store.write(unit, unit.flat[slice(*unit.shard_bounds(self.comm.rank))])
            self.store.flush()

    def close(self, keep_parameters: bool = True) -> None:
        """Remove hooks and (unless `keep_parameters` is false) leave every unit gathered, so the
        module works on its own again; without it the parameters stay empty (no full model in
        memory, e.g. one that fits only because its shards were on NVMe)."""
        super().close()
        if self.module is not None:
            generation.uninstall(self.module)
        if self.reads is not None:
            self.reads.close()
        for index in sorted(self.sharded):
            self.pinned.pop(index, None)
        try:
            if keep_parameters:
                self.unshard(sorted(self.sharded), exact=True)
        finally:
            self.store.close()
            self.gather.close()
            self.reducer.close()


class _Gather:
    """An in-flight all-gather whose source buffer goes back to the store when it completes."""

    def __init__(self, handle, store: ShardStore, unit: Unit):
        self.handle, self.store, self.unit = handle, store, unit

    def wait(self) -> None:
        """Wait for the gather, then release its source."""
        try:
            if self.handle is not None:
                self.handle.wait()
        finally:
            self.store.done(self.unit)


def _in_backward() -> bool:
    """True while autograd is running a backward on this thread (e.g. a checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1
