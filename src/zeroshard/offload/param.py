"""Where stage-3 parameter shards live between gathers: the device, CPU memory or NVMe files.

Only sharded units are placed (persistent small parameters stay whole on the device). The stage-3
policy asks its store for:
  source(unit)  a device tensor holding the unit's shard, to all-gather from; `done(unit)` once
                that gather has completed. CPU: the copy a read-ahead started, else the shard is
                copied to the device now (non-blocking from pinned memory on CUDA). NVMe: the
                shard is read from its swap file into a staging buffer (waiting for a read-ahead
                if one was started).
  read_ahead()  start fetching the next units of the recorded order. CPU: host->device copies
                on a side stream into device staging tensors, at most `buffer_count` units and
                `buffer_size` elements ahead, each with an event the gather waits for (the host
                never does); a write to the shard drops its copy (it would be stale). NVMe: reads
                into free staging buffers (keeping one free for reads nobody predicted).
  read / write  the shard's values (optimizer masters at construction, commits of in-place edits,
                the updated master after each step; NVMe writes are asynchronous and `flush()`
                waits for them, which the policy does before the parameters are used again).
"""

from __future__ import annotations

import torch

from ..dist.hostmem import host_copy, host_empty, strict_host, to_device
from ..core.layout import Unit
from ..core.shard_store import ShardStore
from ..dist.streams import Streams
from .nvme import AsyncIO, BufferPool, NvmeError, SwapDir, aligned_buffer, round_up


class CpuShardStore(ShardStore):
    """Shards in CPU memory (pinned on CUDA), copied to the device ahead of their gather."""

    name = "cpu"

    def __init__(self, units: list[Unit], pin: bool, ahead: int = 2,
                 ahead_numel: int = 100_000_000, *, streams: Streams):
        super().__init__(units)
        self.staged: dict[int, torch.Tensor] = {}
        #: unit index -> (device copy, event after it on the side stream): read-aheads not used yet
        self.prefetched: dict[int, tuple[torch.Tensor, object]] = {}
        self.ahead, self.ahead_numel = ahead, ahead_numel
        #: Sources served from a read-ahead; the most read-aheads (and elements) held at once.
        self.hits = 0
        self.peak_prefetched = self.peak_numel = 0
        self.streams = streams
        for unit in units:
            # Always a new tensor, also when the device is the CPU: an fp32 master taken from the
            # shard stays a copy of its own, as it must be on a GPU machine.
            unit.shard = host_copy(unit.shard, pin=pin)

    def read_ahead(self, indices) -> None:
        """Start copying the next units' shards to the device (bounded; skips gathered ones)."""
        held = sum(t.numel() for t, _ in self.prefetched.values())
        for index in indices:
            if len(self.prefetched) >= self.ahead:
                return
            unit = self.units.get(index)
            if unit is None or index in self.prefetched or index in self.staged or \
                    unit.is_gathered or not self._copies(unit):
                continue
            if held + unit.shard_numel > self.ahead_numel:
                return
            # Allocated on the compute stream, which frees it after the gather (done); the
            # copy runs on the side stream after what the compute stream queued so far.
            copy = torch.empty(unit.shard.shape, dtype=unit.shard.dtype, device=unit.compute_device)
            with self.streams.on("h2d"):
                copy.copy_(unit.shard, non_blocking=unit.shard.is_pinned())
            self.prefetched[index] = (copy, self.streams.record(self.streams.stream("h2d")))
            held += unit.shard_numel
            self.peak_prefetched = max(self.peak_prefetched, len(self.prefetched))
            self.peak_numel = max(self.peak_numel, held)

    @staticmethod
    def _copies(unit: Unit) -> bool:
        """Whether `source` copies (not outside strict mode on a CPU device: it hands the shard)."""
        return unit.compute_device.type != "cpu" or strict_host()

    def source(self, unit: Unit) -> torch.Tensor:
        """The shard on the unit's device: a read-ahead's copy (the current stream waits for it)
        or a copy made now (outside strict mode the shard itself when the device is the CPU);
        kept until `done(unit)`."""
        ahead = self.prefetched.pop(unit.index, None)
        if ahead is not None:
            staged, event = ahead
            self.streams.wait(event)
            self.hits += 1
        else:
            staged = to_device(unit.shard, unit.compute_device)
        self.staged[unit.index] = staged
        return staged

    def done(self, unit: Unit) -> None:
        """Drop the device copy."""
        self.staged.pop(unit.index, None)

    def write(self, unit: Unit, values: torch.Tensor) -> None:
        """Set the shard; a read-ahead of the old values is dropped (after its copy is done: it
        reads the host memory written now)."""
        stale = self.prefetched.pop(unit.index, None)
        if stale is not None and stale[1] is not None and not stale[1].query():
            stale[1].synchronize()  # only if that copy is somehow still running
        super().write(unit, values)

    def device_buffers(self) -> list[torch.Tensor]:
        """Read-ahead copies not used yet, and copies feeding a gather in flight."""
        return [t for t, _ in self.prefetched.values()] + list(self.staged.values())

    def close(self) -> None:
        """Drop read-aheads not used."""
        self.prefetched.clear()


class NvmeShardStore(ShardStore):
    """Shards in swap files, read into a bounded pool of staging buffers in the recorded order."""

    name = "nvme"

    def __init__(self, units: list[Unit], spec, aio, rank: int, *, streams: Streams):
        super().__init__(units)
        self.swap = SwapDir(spec.nvme_path, rank, "param", "zero_optimization.offload_param")
        nbytes = {u.index: u.shard.numel() * u.shard.element_size() for u in units}
        self.swap.require_space(sum(round_up(b) for b in nbytes.values()))
        self.pool = BufferPool(max(nbytes.values() or [1]), max(2, spec.buffer_count),
                               pin=spec.pin_memory)
        self.io = AsyncIO(threads=max(aio.thread_count, aio.intra_op_parallelism) * aio.queue_depth,
                          block_size=aio.block_size)
        self.reads: dict[int, tuple] = {}  # unit index -> (request, buffer): started reads
        # unit index -> (buffer, pooled, event after its copy to the device): sources being gathered
        self.held: dict[int, tuple] = {}
        self.streams = streams
        self.writes: dict[int, list] = {}  # unit index -> write requests in flight
        for unit in units:
            self.swap.create(self._file(unit), nbytes[unit.index])
            buffer = self.pool.take()
            _typed(buffer, unit).copy_(unit.shard)
            self.io.write(self.swap, self._file(unit), buffer).wait()
            self.pool.give(buffer)
            unit.shard = host_empty(0, unit.shard.dtype)  # on disk now

    @staticmethod
    def _file(unit: Unit) -> str:
        return f"u{unit.index}"

    def _start_read(self, unit: Unit, buffer: torch.Tensor):
        self._wait_writes(unit.index)
        return self.io.read(self.swap, self._file(unit), buffer), buffer

    def _wait_writes(self, index: int) -> None:
        for request in self.writes.pop(index, []):
            request.wait()

    def read_ahead(self, indices) -> None:
        """Start reading upcoming units while more than one buffer is free."""
        for index in indices:
            if len(self.pool.free) <= 1:
                return
            unit = self.units.get(index)
            if unit is None or index in self.reads or index in self.held or unit.is_gathered:
                continue
            self.reads[index] = self._start_read(unit, self.pool.take())

    def _buffer(self) -> tuple[torch.Tensor, bool]:
        """A staging buffer: a free one, one taken back from a read-ahead, or (when every
        buffer feeds a gather in flight) a temporary one outside the pool."""
        if not self.pool.free and self.reads:
            index = next(iter(self.reads))
            request, buffer = self.reads.pop(index)
            request.wait()
            return buffer, True
        if self.pool.free or self.pool.count > len(self.held):
            return self.pool.take(), True
        return aligned_buffer(self.pool.nbytes), False

    def source(self, unit: Unit) -> torch.Tensor:
        """The shard read from disk (into a staging buffer, then to the device if not the CPU)."""
        started = self.reads.pop(unit.index, None)
        if started is None:
            buffer, pooled = self._buffer()
            started = self._start_read(unit, buffer)
        else:
            pooled = True
        request, buffer = started
        try:
            request.wait()
        except NvmeError as err:
            if pooled:
                self.pool.give(buffer)
            raise NvmeError(err.errno, f"{err} (the shard of {unit.describe()}, needed for its "
                            "all-gather); no parameter or optimizer state was changed: retry, or "
                            "load the last checkpoint") from err
        # Non-blocking from a pinned buffer: the buffer goes back to the pool once the copy's
        # event is done, waited for on an I/O thread (`done`), never by the host.
        out = to_device(_typed(buffer, unit), unit.compute_device)
        self.held[unit.index] = (buffer, pooled, self.streams.record())
        return out

    def done(self, unit: Unit) -> None:
        """Give the staging buffer back (once its copy to the device is done)."""
        held = self.held.pop(unit.index, None)
        if held is not None and held[1]:
            buffer, _, copied = held
            self.io.after(copied, lambda: self.pool.give(buffer))

    def read(self, unit: Unit) -> torch.Tensor:
        """A fresh copy of the shard from disk."""
        buffer, pooled = self._buffer()
        request, _ = self._start_read(unit, buffer)
        try:
            request.wait()
            return host_copy(_typed(buffer, unit))
        finally:
            if pooled:
                self.pool.give(buffer)

    def write(self, unit: Unit, values: torch.Tensor) -> None:
        """Cast `values` into a staging buffer and start writing it (any read-ahead is dropped)."""
        stale = self.reads.pop(unit.index, None)
        if stale is not None:
            stale[0].wait()
            self.pool.give(stale[1])
        self._wait_writes(unit.index)
        buffer = self.pool.take()
        copied = None
        if values.device.type != "cpu" and buffer.is_pinned():
            # A master on the device: copied without the host waiting; the I/O threads wait.
            _typed(buffer, unit).copy_(values, non_blocking=True)
            copied = self.streams.record()
        else:
            _typed(buffer, unit).copy_(values)
        self.writes.setdefault(unit.index, []).append(
            self.io.write(self.swap, self._file(unit), buffer,
                          on_done=lambda b=buffer: self.pool.give(b), before=copied))

    def flush(self) -> None:
        """Wait for every write; raise the first failure."""
        error = None
        for index in list(self.writes):
            try:
                self._wait_writes(index)
            except NvmeError as err:
                error = error or err
        if error is not None:
            raise error

    def drain(self) -> None:
        """Wait for every write, dropping failures (they were reported already)."""
        for index in list(self.writes):
            for request in self.writes.pop(index):
                try:
                    request.wait()
                except NvmeError:
                    pass

    def tensors(self) -> list[torch.Tensor]:
        """Nothing is kept in memory."""
        return []

    def buffers(self) -> list[torch.Tensor]:
        """The staging pool."""
        return self.pool.tensors() + [held[0] for held in self.held.values()] + \
            [b for _, b in self.reads.values()]

    def nvme_bytes(self) -> int:
        """Bytes of this rank's parameter swap files."""
        return self.swap.nbytes()

    def close(self) -> None:
        """Finish writes, stop threads, delete the swap files."""
        try:
            self.flush()
        finally:
            self.io.close()
            self.swap.close()


def _typed(buffer: torch.Tensor, unit: Unit) -> torch.Tensor:
    """The first shard-sized elements of a uint8 staging buffer, in the unit's dtype."""
    return buffer.view(unit.dtype)[:unit.shard_numel]


def make_store(spec, aio, units: list[Unit], rank: int, *, streams: Streams) -> ShardStore:
    """The store `offload_param` asks for (None or device "none": the device), queuing its copies
    on the step's `streams`."""
    device = spec.device if spec is not None else "none"
    if device == "nvme":
        return NvmeShardStore(units, spec, aio, rank, streams=streams)
    if device == "cpu":
        return CpuShardStore(units, spec.pin_memory, ahead=spec.buffer_count,
                             ahead_numel=spec.buffer_size, streams=streams)
    return ShardStore(units)
