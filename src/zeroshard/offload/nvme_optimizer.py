"""ZeRO-Infinity's optimizer placement: fp32 masters and optimizer state in NVMe swap files.

Step plan: masters and state live in swap files (`nvme.py`); the step goes unit by unit through a
bounded pool of staging buffers: read unit i+1's master and state (`pipeline_read`) while
stepping unit i, while unit i-1 is written back (`pipeline_write`). A staging buffer goes back to
the pool once its write is done and the copy of the master to the device has finished (an event
waited for by the I/O thread, not by the step). A failed write leaves the step partly applied on
disk: the optimizer then refuses further steps until a checkpoint is loaded (which rewrites every
swap file).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..dist.hostmem import host_copy, host_empty, host_zeros, to_host
from ..dist.hostsync import HostSyncs
from ..core.layout import ALIGN, Unit
from ..dist.streams import Streams
from .nvme import AsyncIO, BufferPool, NvmeError, SwapDir, round_up
from .optimizer import Placement, _num_threads, _offload_threads, _scale, reseat


class NvmePlacement(Placement):
    """Masters and optimizer state in swap files, stepped unit by unit through staging buffers."""

    def __init__(self, optimizer, units, owned: list[torch.Tensor], spec, aio, rank: int, *,
                 syncs: HostSyncs | None = None, streams: Streams):
        """Write each unit's owned slice (`owned`, full precision) as its master's swap file and
        re-seat `optimizer` on placeholder masters (filled unit by unit during the step)."""
        self.optimizer = optimizer
        self.units = units
        self.name = "nvme"
        self.device = torch.device("cpu")
        self.step_in_backward = False  # its step goes unit by unit through I/O after backward
        self.early = None
        self.stepped_early = False
        self.on_cuda = any(u.compute_device.type == "cuda" for u in units)
        #: Where the gradient norm is formed when there is no gradient at all.
        self.compute_device = units[0].compute_device if units else self.device
        self.threads = _offload_threads() if self.on_cuda else None
        self.grad_buffers = None
        self.grads = None
        self.syncs = syncs if syncs is not None else HostSyncs()
        self.streams = streams
        self.pipeline_read = bool(spec.pipeline_read)
        self.pipeline_write = bool(spec.pipeline_write)
        self.kinds = {g: _state_kinds(optimizer, g) for g in range(len(optimizer.param_groups))}
        self.present: dict[int, list[str]] = {u.index: [] for u in units}  # kinds written so far
        self.swap = SwapDir(spec.nvme_path, rank, "optimizer", "zero_optimization.offload_optimizer")
        shard_bytes = {u.index: u.shard_numel * 4 for u in units}
        self.swap.require_space(sum(round_up(shard_bytes[u.index]) * (1 + len(self.kinds[u.group_index]))
                                    for u in units))
        per_unit = 1 + max([len(k) for k in self.kinds.values()] or [0])
        sets = 1 + self.pipeline_read + self.pipeline_write
        self.pool = BufferPool(max(shard_bytes.values() or [ALIGN * 4]),
                               max(spec.buffer_count, per_unit * sets), pin=spec.pin_memory)
        self.io = AsyncIO(threads=max(aio.thread_count, aio.intra_op_parallelism) * aio.queue_depth,
                          block_size=aio.block_size)
        self.placeholder = host_empty(0)
        self.masters = []
        for unit, slice_ in zip(units, owned):
            for kind in ["master"] + self.kinds[unit.group_index]:
                self.swap.create(_name(unit, kind), shard_bytes[unit.index])
            buffer = self.pool.take()
            data = buffer.view(torch.float32)[:unit.shard_numel]
            data.copy_(slice_)
            self.io.write(self.swap, _name(unit, "master"), buffer).wait()
            self.pool.give(buffer)
            self.masters.append(nn.Parameter(self.placeholder, requires_grad=True))
        reseat(optimizer, units, self.masters)

    def sq_norm(self, grads: list[torch.Tensor], norm: bool = True) -> torch.Tensor | None:
        """Sum of squares of the gradients, one unit at a time (no fp32 copy of all of them),
        formed where they are: on the device at stage 1, in host memory at stages 2-3 (None with
        `norm` false: the gradients are only kept for the step)."""
        self.grads = grads
        if not norm:
            return None
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g.numel()]
        if not norms:
            return torch.zeros(1, dtype=torch.float64, device=self.compute_device)
        return torch.stack(norms).double().pow(2).sum().reshape(1)

    def can_mask(self) -> bool:
        """The overflow flag is read before an NVMe step (it runs unit by unit through I/O)."""
        return False

    def step(self, factor, found_inf: torch.Tensor | None, write_owned) -> set[int]:
        """Read, step and write back one unit at a time, overlapping I/O with the step."""
        factor, _ = self._for_step(factor, None)
        units = [u for u in self.units if u.shard_numel]
        ahead = 1 if self.pipeline_read else 0
        reads: dict[int, tuple[list, dict]] = {}
        writes = []
        current = None  # the unit being stepped: its reads are done, its writes not started
        try:
            for i, unit in enumerate(units):
                for nxt in units[i:i + 1 + ahead]:
                    if nxt.index not in reads:
                        reads[nxt.index] = self._start_read(nxt)
                current = reads.pop(unit.index)
                for request in current[0]:
                    request.wait()
                copied = self._step_unit(unit, current[1], factor, write_owned)
                writes.extend(self._start_write(unit, current[1], copied))
                current = None  # its buffers go back to the pool as its writes finish
                if not self.pipeline_write:
                    _wait_all(writes)
                    writes.clear()
            _wait_all(writes)
        except NvmeError:
            if current is not None:
                reads[-1] = current
            self._abandon(reads, writes)
            raise
        finally:
            self.grads = None
        return set()

    def _start_read(self, unit: Unit):
        buffers = {kind: self.pool.take() for kind in ["master"] + self.present[unit.index]}
        requests = [self.io.read(self.swap, _name(unit, kind), buf) for kind, buf in buffers.items()]
        return requests, buffers

    def _step_unit(self, unit: Unit, buffers: dict, factor: float, write_owned) -> None:
        master = self.masters[unit.index]
        n = unit.shard_numel
        master.data = buffers["master"].view(torch.float32)[:n]
        state = self.optimizer.state.get(master)
        for kind in self.present[unit.index]:
            state[kind] = buffers[kind].view(torch.float32)[:n]
        grad = self.grads[unit.index]
        fp32 = to_host(grad, torch.float32)  # stage 1: the gradient is still on the device
        if torch.is_tensor(factor) or factor != 1.0:
            fp32 = host_copy(fp32) if fp32 is grad else fp32
            _scale([fp32], factor)
        master.grad = fp32
        group = self.optimizer.param_groups[unit.group_index]
        saved = self.optimizer.param_groups
        self.optimizer.param_groups = [dict(group, params=[master])]
        try:
            with _num_threads(self.threads):
                self.optimizer.step()
        finally:
            self.optimizer.param_groups = saved
            master.grad = None
        write_owned(unit, master.data)
        # The copy to the device may still read the staging buffer: its event goes with the
        # buffer's write, and the buffer is reused only after both (`_start_write`).
        copied = self.streams.record()
        # The first step created the state tensors: move them into staging buffers.
        state = self.optimizer.state[master]
        for kind in self.kinds[unit.group_index]:
            if kind not in buffers:
                buffer = self.pool.take()
                buffer.view(torch.float32)[:n].copy_(state[kind])
                buffers[kind] = buffer
                self.present[unit.index].append(kind)
        return copied

    def _start_write(self, unit: Unit, buffers: dict, copied=None) -> list:
        master = self.masters[unit.index]
        master.data = self.placeholder
        state = self.optimizer.state[master]
        for kind in buffers:
            if kind != "master":
                state[kind] = self.placeholder
        def give(buf):
            if copied is not None:
                copied.synchronize()  # on the I/O thread: the step goes on meanwhile
            self.pool.give(buf)

        return [self.io.write(self.swap, _name(unit, kind), buf, on_done=lambda b=buf: give(b))
                for kind, buf in buffers.items()]

    def _abandon(self, reads: dict, writes: list) -> None:
        """After a failure: finish what is in flight and return every buffer to the pool."""
        for requests, buffers in reads.values():
            for request in requests:
                with contextlib.suppress(NvmeError):
                    request.wait()
            for buf in buffers.values():
                self.pool.give(buf)
        for request in writes:
            with contextlib.suppress(NvmeError):
                request.wait()
        for master in self.masters:
            master.grad = None
            if master.data.numel():
                master.data = self.placeholder

    def drop_grads(self) -> None:
        """Nothing is attached between steps."""
        self.grads = None

    # -- checkpoints and in-place edits --------------------------------------------------------------
    def tensors(self, unit: Unit) -> tuple[torch.Tensor, dict]:
        """Master and state as tensors mapped onto the swap files (writes reach the files)."""
        n = unit.shard_numel
        master = self.masters[unit.index]
        state = dict(self.optimizer.state.get(master, {}))
        for kind in self.present[unit.index]:
            state[kind] = self.swap.mapped(_name(unit, kind), n, torch.float32)
        return self.swap.mapped(_name(unit, "master"), n, torch.float32), state

    def install(self, unit: Unit, values: torch.Tensor, state: dict | None) -> None:
        """Write `values` (and `state`'s tensors) into the swap files; scalars stay in memory."""
        master, current = self.tensors(unit)
        if values.data_ptr() != master.data_ptr():
            master.copy_(values)
        if state is None:
            return
        kept = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() and key in self.kinds[unit.group_index]:
                target = current.get(key) if key in self.present[unit.index] else None
                if target is None:
                    target = self.swap.mapped(_name(unit, key), unit.shard_numel, torch.float32)
                    self.present[unit.index].append(key)
                if target.data_ptr() != value.data_ptr():
                    target.copy_(value)
                kept[key] = self.placeholder
            else:
                kept[key] = value
        self.optimizer.state[self.masters[unit.index]] = kept

    def update_master(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        """Overwrite elements `[lo, hi)` of the unit's master on disk."""
        master, _ = self.tensors(unit)
        master[lo:hi].copy_(values)
        self.flush()

    def flush(self) -> None:
        """fsync the swap files after writes through mapped views."""
        self.swap.sync()

    # -- ledger --------------------------------------------------------------------------------------
    def ledger(self) -> dict[str, list]:
        """Nothing of the optimizer stays in memory between steps except scalars."""
        return {"nvme": []}

    def nvme_bytes(self) -> int:
        """Bytes of this rank's optimizer swap files."""
        return self.swap.nbytes()

    def buffer_ledger(self) -> dict[str, list]:
        """The staging pool (all of it is allocated for the whole run)."""
        return {"cpu": [b for b in self.pool.tensors()]}

    def close(self) -> None:
        """Stop the I/O threads and delete the swap files."""
        self.io.close()
        self.swap.close()


def _name(unit: Unit, kind: str) -> str:
    return f"u{unit.index}-{kind}"


def _wait_all(requests) -> None:
    error = None
    for request in requests:
        try:
            request.wait()
        except NvmeError as err:
            error = error or err
    if error is not None:
        raise error


def _state_kinds(optimizer: torch.optim.Optimizer, group_index: int) -> list[str]:
    """Names of the shard-sized state tensors `optimizer` keeps for a parameter of this group,
    found by stepping a 16-element probe parameter once with a zero gradient."""
    probe = nn.Parameter(host_zeros(ALIGN))
    probe.grad = host_zeros(ALIGN)
    saved = optimizer.param_groups
    optimizer.param_groups = [dict(saved[group_index], params=[probe])]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved
    state = optimizer.state.pop(probe, {})
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == probe.shape]
