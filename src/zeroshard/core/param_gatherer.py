"""Stage 3's parameter gatherer: which units are whole on this rank, and making them so.

Units (`partition.py`) keep only this rank's 1/N shard between uses. A unit's full flat buffer
object stays but its storage is emptied (the bytes go back to a pool), so views of it that
autograd saved in forward see the data again once it is refilled; meanwhile its parameters hold
empty tensors. The gatherer is told *what* to make whole and when a use is over; the stage-3
policy (`stage3.py`) decides *when*, from its hooks.

  unshard     start the gathers (through the gather strategy, `strategies.py`: plain, qwZ, hpZ,
              MiCS's shard group) and wait for them; shards placed off the device come through
              the shard store (`offload/param.py`) on the "gather" side stream
  prefetch    start the gathers of the next units in the recorded order (`schedule.py`), within
              stage3_prefetch_bucket_size and stage3_max_live_parameters
  reshard     free a unit's full buffer, unless a module running forward or a GatheredParameters
              context still holds it
  pin / unpin keep units whole across calls (GatheredParameters); `hold_all` every unit (generate)
  after_step  all-gather the persistent units (small parameters kept whole) and pinned ones from
              the updated shards
"""

from __future__ import annotations

import contextlib

import torch

from ..dist import Comm
from .layout import StoragePool, Unit, ZeroParamStatus, set_status
from .partition import Stage3Layout
from .schedule import Schedule
from .shard_store import ShardStore
from .spec import Stage3Options
from .strategies import Gather
from ..dist.streams import Streams


class ParamGatherer:
    """The gathered / released state of stage 3's units and the gathers that change it."""

    def __init__(self, units: list[Unit], layout: Stage3Layout, comm: Comm,
                 options: Stage3Options, *, gather: Gather, store: ShardStore | None,
                 streams: Streams):
        """`units`: the trained units (the layout's frozen ones are added); `store`: where the
        sharded units' shards live (None: on the compute device)."""
        self.layout = layout
        self.comm = comm
        self.options = options
        self.gather = gather
        self.streams = streams
        self.by_index = {u.index: u for u in [*units, *layout.frozen]}
        self.sharded = {i for i in self.by_index if i not in layout.persistent}
        # On CPU, freed 28 MB buffers stay in glibc's heap; CUDA's caching allocator reuses them.
        on_cpu = all(u.compute_device.type == "cpu" for u in units)
        self.gathered_pool = StoragePool() if on_cpu and \
            hasattr(torch.UntypedStorage, "_swap_data_ptr_") else None
        self.schedule = Schedule({u.index: u.padded_numel for u in self.by_index.values()},
                                 options.max_reuse_distance)
        self.store = store if store is not None else \
            ShardStore([u for u in self.by_index.values() if u.index in self.sharded])
        self.pending: dict[int, _GatherHandle] = {}  # unit index -> its gather in flight
        self.active: dict[int, int] = {}  # unit index -> modules running forward that need it
        self.pinned: dict[int, int] = {}  # unit index -> GatheredParameters contexts holding it
        self.holding_all = 0  # `hold_all` blocks running (generate): the forward hooks step aside
        self.live_numel = 0
        self.peak_live_numel = 0
        self.lossy: set[int] = set()  # gathered units holding qwZ-decoded (not exact) weights
        for unit in units:  # persistent units are whole; sharded ones arrive released
            if unit.index not in self.sharded:
                set_status(unit, ZeroParamStatus.AVAILABLE)

    # -- gathering -------------------------------------------------------------------------------
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
            handle = self.gather.start(flat, source, unit, exact)
        if handle.lossy:
            self.lossy.add(unit.index)
        self.pending[unit.index] = _GatherHandle(handle, self.store, unit)

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
                self._gather_exact(self.by_index[index])
                self.lossy.discard(index)
            set_status(self.by_index[index], ZeroParamStatus.AVAILABLE)

    def prefetch(self) -> None:
        """Start gathering the next units of the recorded order, within the budgets."""
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

    def keeps_soon(self, index: int) -> bool:
        """Whether unit `index` is needed again soon enough to stay gathered (within budget)."""
        return self.schedule.reuse_soon(index) and \
            self.live_numel <= self.options.max_live_parameters

    # -- releasing -------------------------------------------------------------------------------
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

    def reshard_unit(self, unit: Unit) -> None:
        """`reshard` by unit (the gradient reducer's after-launch call)."""
        self.reshard(unit.index)

    def reshard_all(self, skip_running: bool = False) -> None:
        """Free every gathered (unpinned) unit; `skip_running`: not those a running module needs."""
        for index in sorted(self.sharded):
            if not (skip_running and self.active.get(index)):
                self.reshard(index)

    def release_after_forward(self, index: int, backward_follows: bool) -> None:
        """A unit's forward use is over: free it, after the gather strategy kept what makes its
        backward gather cheaper (hpZ's secondary shard) when a backward will need it."""
        unit = self.by_index[index]
        if backward_follows and index in self.sharded and unit.is_gathered and \
                index not in self.pending and not self.pinned.get(index):
            self.gather.keep(unit, index in self.lossy)
        self.reshard(index)

    # -- held across calls -----------------------------------------------------------------------
    def pin(self, indices) -> None:
        """Gather the listed units and keep them gathered until `unpin` (GatheredParameters)."""
        indices = sorted(i for i in set(indices) if i in self.sharded)
        for index in indices:
            self.pinned[index] = self.pinned.get(index, 0) + 1
        self.unshard(indices, exact=True)

    def unpin(self, indices, detach: bool = True) -> None:
        """Undo one `pin`; units no module is running are freed (`detach`: see Unit.release)."""
        for index in sorted(i for i in set(indices) if i in self.sharded):
            self.pinned[index] = max(0, self.pinned.get(index, 0) - 1)
            if not self.active.get(index):
                self.reshard(index, detach=detach)

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

    # -- around the optimizer step ----------------------------------------------------------------
    def read_owned(self, unit: Unit) -> torch.Tensor:
        """A sharded unit's shard values, from wherever the shard is placed."""
        return self.store.read(unit)

    def write_owned(self, unit: Unit, values: torch.Tensor) -> None:
        """Set a sharded unit's shard (wherever it is placed) from `values`."""
        self.gather.forget(unit.index)
        self.store.write(unit, values)

    def commit(self, unit: Unit) -> None:
        """Copy this rank's slice of a gathered unit's (changed) full buffer into its shard."""
        self.gather.forget(unit.index)
        if unit.index in self.sharded and unit.is_gathered:
            self.store.write(unit, unit.flat[slice(*unit.shard_bounds(self.comm.rank))])
            self.store.flush()

    def after_step(self) -> None:
        """All-gather the persistent units (and pinned ones); the rest wait for their next use.
        What the gather strategy kept of the old weights is dropped first (its memory goes back)."""
        self.gather.forget()
        self.store.flush()  # updated shards written back (NVMe) before anyone reads them
        for index in sorted(self.layout.persistent):
            unit = self.by_index[index]
            lo, hi = unit.shard_bounds(self.comm.rank)
            self.gather.start(unit.flat, unit.flat[lo:hi], unit, exact=True).wait()
        for index in sorted(i for i, n in self.pinned.items() if n):
            # A model gathered for inference (GatheredParameters) sees the updated weights.
            unit = self.by_index[index]
            self._gather_exact(unit)
            set_status(unit, ZeroParamStatus.AVAILABLE)

    def _gather_exact(self, unit: Unit) -> None:
        """Fill a gathered unit's full buffer again, exactly, from the shards (waits)."""
        try:
            self.gather.start(unit.flat, self.store.source(unit), unit, exact=True).wait()
        finally:
            self.store.done(unit)

    def reset(self) -> None:
        """Wait for gathers in flight and free every unit no GatheredParameters context pins."""
        for index in list(self.pending):
            self.pending.pop(index).wait()
        self.active.clear()
        self.reshard_all()
        self.gather.forget()

    def empty_cache(self) -> None:
        """Free every gathered unit that no module runs and no context pins, and the pool's
        spare blocks (`engine.empty_partition_cache`)."""
        self.reshard_all(skip_running=True)
        if self.gathered_pool is not None:
            self.gathered_pool.clear()

    def close(self, keep_parameters: bool) -> None:
        """Leave every unit gathered (`keep_parameters`), or empty; release the store's files and
        threads and the strategy's groups."""
        for index in sorted(self.sharded):
            self.pinned.pop(index, None)
        try:
            if keep_parameters:
                self.unshard(sorted(self.sharded), exact=True)
        finally:
            self.store.close()
            self.gather.close()

    # -- for the memory ledger ---------------------------------------------------------------------
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

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Device copies of offloaded shards (read ahead) and spare gathered-unit memory."""
        return self.store.device_buffers() + \
            (self.gathered_pool.tensors() if self.gathered_pool else [])


class _GatherHandle:
    """An in-flight gather whose source buffer goes back to the store when it completes."""

    def __init__(self, handle, store: ShardStore, unit: Unit):
        self.handle, self.store, self.unit = handle, store, unit

    def wait(self) -> None:
        """Wait for the gather, then release its source."""
        try:
            if self.handle is not None:
                self.handle.wait()
        finally:
            self.store.done(self.unit)
