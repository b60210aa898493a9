"""DeepSpeed's CPU accelerator (see accelerator.py): one host device, gloo, memory from /proc.

As in DeepSpeed: the device name is "cpu" without an index, the current device is the local
rank, bf16 is supported and fp16 when oneDNN has fp16 kernels for this processor, and the memory
counters are this process's resident set. Unlike DeepSpeed's, the peak is also the kernel's own
high-water mark (VmHWM, reset by writing 5 to /proc/self/clear_refs), and `Stream` / `Event` are
host classes instead of None: work "on" a host stream is done when submitted, and an event
records the host clock, so `elapsed_time` times host code.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time

import torch

from ....dist.comm import computes_in_fp16
from .base import DeepSpeedAccelerator

__all__ = ["CpuAccelerator", "CpuEvent", "CpuStream"]


class CpuAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's CPU accelerator: one host device, gloo, memory read from /proc."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        """Always "cpu" (there is one host device, whatever the rank)."""
        return "cpu"

    def device(self, device_index: int | None = None):
        """A context that changes nothing (there is one host device)."""
        return contextlib.nullcontext()

    def set_device(self, device_index: int) -> None:
        """Nothing to select on the host."""

    def current_device(self) -> int:
        """This process's local rank, as DeepSpeed's CPU accelerator answers."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def current_device_name(self) -> str:
        """"cpu"."""
        return "cpu"

    def device_count(self) -> int:
        """Processes on this host (torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE), else 1."""
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            value = os.environ.get(name)
            if value and int(value) > 0:
                return int(value)
        return 1

    def is_available(self) -> bool:
        """The host is always there."""
        return True

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU kernels have finished when they return."""

    def is_synchronized_device(self) -> bool:
        """CPU kernels finish before the host goes on."""
        return True

    def is_bf16_supported(self) -> bool:
        """torch computes in bf16 on every CPU (as DeepSpeed says)."""
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fp16 kernels for this processor (DeepSpeed's test)."""
        return computes_in_fp16(torch.device("cpu"))

    def manual_seed(self, seed: int):
        """Seed torch's generator."""
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        """Seed torch's generator (the host has one)."""
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """torch's generator seed."""
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """torch's RNG state."""
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore torch's RNG state."""
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int | None = None):
        """torch's default generator."""
        return torch.default_generator

    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        """A stream class whose work is done at once (host code is synchronous)."""
        return CpuStream

    def stream(self, stream):
        """A context that changes nothing."""
        return contextlib.nullcontext(stream)

    def current_stream(self, device_index: int | None = None):
        """A no-op stream."""
        return CpuStream()

    def default_stream(self, device_index: int | None = None):
        """A no-op stream."""
        return CpuStream()

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        """An event class that records the host clock."""
        return CpuEvent

    def empty_cache(self) -> None:
        """Give the spare stage-3 gathered-unit memory of every engine back to the host."""
        from zeroshard.core.layout import StoragePool

        for pool in list(StoragePool.live):
            pool.clear()

    def memory_allocated(self, device_index=None) -> int:
        """This process's resident memory in bytes."""
        rss = _rss()
        self._seen_peak = max(getattr(self, "_seen_peak", 0), rss)
        return rss

    def max_memory_allocated(self, device_index=None) -> int:
        """This process's peak resident memory since the last reset, in bytes (the kernel
        updates its mark lazily, so what earlier calls saw counts too)."""
        return max(_peak_rss(), self.memory_allocated(), self._seen_peak)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        """Start a new peak from the current resident memory."""
        _reset_peak()
        self._seen_peak = _rss()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None) -> dict:
        """Current and peak resident bytes under torch.cuda.memory_stats' key names."""
        return {"allocated_bytes.all.current": _rss(),
                "allocated_bytes.all.peak": self.max_memory_allocated()}

    def total_memory(self, device_index=None) -> int:
        """The host's physical memory in bytes."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        """Memory the kernel says is available (MemAvailable), in bytes."""
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def range_push(self, msg: str, domain=None, category=None) -> None:
        """Profiler ranges are a CUDA (NVTX) feature: nothing on the host."""

    def range_pop(self, domain=None) -> None:
        """Profiler ranges are a CUDA (NVTX) feature: nothing on the host."""

    def lazy_call(self, callback):
        """Run `callback` now."""
        return callback()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """The tensor itself: without a GPU there is nothing to pin for."""
        return tensor

    def create_graph(self):
        """No graphs on the host."""
        return None

    def capture_to_graph(self, graph, pool=None, stream=None):
        """A context that captures nothing."""
        return contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        """Nothing to replay."""


class CpuStream:
    """A host "stream": work submitted to it is already done, so waiting is free."""

    def __init__(self, device=None, priority: int = 0, **_ignored):
        self.device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        """Nothing to wait for."""

    def wait_event(self, event) -> None:
        """Nothing to wait for."""

    def record_event(self, event=None) -> "CpuEvent":
        """Record (and return) an event at the current host time."""
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True


class CpuEvent:
    """A host "event": `record` notes the clock, `elapsed_time` is milliseconds between two."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.time: float | None = None

    def record(self, stream=None) -> None:
        """Note the host clock."""
        self.time = time.perf_counter()

    def wait(self, stream=None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always done."""
        return True

    def elapsed_time(self, end_event: "CpuEvent") -> float:
        """Milliseconds from this event's record to `end_event`'s."""
        if self.time is None or end_event.time is None:
            raise RuntimeError("elapsed_time needs both events recorded (event.record())")
        return (end_event.time - self.time) * 1000.0


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _rss() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    """Linux resets the high-water mark to the current RSS when "5" is written to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass  # elsewhere the peak is the process's lifetime peak
