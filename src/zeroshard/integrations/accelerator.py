"""DeepSpeed's accelerator interface, `deepspeed.accelerator.get_accelerator()`, for CPU and CUDA.

DeepSpeed's examples reach the device through this object instead of `torch.cuda`
(`get_accelerator().device_name(local_rank)`, `.synchronize()`, `.memory_allocated()`, ...), so
a script written for DeepSpeed runs here unchanged. `get_accelerator()` picks CUDA when torch
sees a GPU and the CPU otherwise, or what `DS_ACCELERATOR` ("cuda" / "cpu") names, as DeepSpeed.

On the CPU, as in DeepSpeed's CPU accelerator: the device name is "cpu", the collective backend
gloo, bf16 is supported and fp16 when oneDNN has fp16 kernels for this processor, and the memory
counters are this process's resident set. Unlike DeepSpeed's, the peak is the kernel's own
high-water mark (`VmHWM`, reset through /proc/self/clear_refs) rather than a sample taken at each
call, and `Stream` / `Event` are no-op classes (an event records the host clock, so
`elapsed_time` times host code) instead of None, so stream-and-event code runs unchanged.
DeepSpeed's compiled-op builders (`create_op_builder`, ...) do not exist here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time

import torch

__all__ = ["CpuAccelerator", "CudaAccelerator", "DeepSpeedAccelerator", "get_accelerator",
           "is_current_accelerator_supported"]

_KINDS = ("cuda", "cpu")


class DeepSpeedAccelerator:
    """What CPU and CUDA share: tensor helpers, RNG, graphs off, no compiled ops."""

    _name = "none"
    _communication_backend_name = "none"

    def __init__(self):
        self._compile_backend = "inductor"

    # -- the device --------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """"cuda" / "cuda:<i>", or "cpu" (DeepSpeed gives the CPU no index)."""
        raise NotImplementedError

    def current_device_name(self) -> str:
        """The name of the device this process computes on."""
        raise NotImplementedError

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device ("nccl" or "gloo")."""
        return self._communication_backend_name

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives on this accelerator."""
        return tensor.device.type == self._name

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict the visible devices."""
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids) -> None:
        """Make only `local_accelerator_ids` visible in `current_env`."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(str(i) for i in local_accelerator_ids)

    def export_envs(self) -> list[str]:
        """Environment variable prefixes a multi-node launcher forwards (NCCL's for CUDA)."""
        return []

    # -- RNG -----------------------------------------------------------------------------------------
    def random(self):
        """torch's RNG module."""
        return torch.random

    def is_synchronized_device(self) -> bool:
        """Whether kernels finish before the host goes on (the CPU)."""
        return False

    def use_host_timers(self) -> bool:
        """Whether timers read the host clock rather than device events."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent work itself (the CPU)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether allocation waits for memory by itself (the CPU)."""
        return self.is_synchronized_device()

    # -- precision -----------------------------------------------------------------------------------
    def supported_dtypes(self) -> list[torch.dtype]:
        """Floating dtypes this device computes in."""
        out = [torch.float32]
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        if self.is_fp16_supported():
            out.append(torch.float16)
        return out

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run (never relied on by zeroshard)."""
        return False

    # -- tensors -------------------------------------------------------------------------------------
    def _tensor(self, dtype):
        return functools.partial(torch.tensor, dtype=dtype, device=self.device_name())

    BFloat16Tensor = property(lambda self: self._tensor(torch.bfloat16))
    ByteTensor = property(lambda self: self._tensor(torch.uint8))
    DoubleTensor = property(lambda self: self._tensor(torch.float64))
    FloatTensor = property(lambda self: self._tensor(torch.float32))
    HalfTensor = property(lambda self: self._tensor(torch.float16))
    IntTensor = property(lambda self: self._tensor(torch.int32))
    LongTensor = property(lambda self: self._tensor(torch.int64))

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is in page-locked host memory."""
        return tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pageable copy of a pinned tensor (the tensor itself otherwise)."""
        return tensor.clone() if tensor.is_pinned() else tensor

    # -- compilation ---------------------------------------------------------------------------------
    def get_compile_backend(self) -> str:
        """The torch.compile backend DeepSpeed would use."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Set the torch.compile backend (any registered one)."""
        if backend not in torch._dynamo.list_backends(exclude_tags=()):
            raise ValueError(f"set_compile_backend({backend!r}): not a torch.compile backend; "
                             f"choose from {torch._dynamo.list_backends(exclude_tags=())}")
        self._compile_backend = backend

    def op_builder_dir(self):
        """DeepSpeed's compiled-op builders do not exist in zeroshard."""
        raise _no_ops("op_builder_dir")

    def create_op_builder(self, class_name: str):
        """DeepSpeed's compiled-op builders do not exist in zeroshard."""
        raise _no_ops(f"create_op_builder({class_name!r})")

    def get_op_builder(self, class_name: str):
        """DeepSpeed's compiled-op builders do not exist in zeroshard."""
        raise _no_ops(f"get_op_builder({class_name!r})")

    def build_extension(self):
        """DeepSpeed's compiled-op builders do not exist in zeroshard."""
        raise _no_ops("build_extension")

    def __repr__(self) -> str:
        return f"<zeroshard {self._name} accelerator>"


class CudaAccelerator(DeepSpeedAccelerator):
    """DeepSpeed's CUDA accelerator: every call is torch.cuda's."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def device_name(self, device_index: int | None = None) -> str:
        """"cuda", or "cuda:<i>" for an index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None):
        """torch.cuda.device(i): a context that makes device i current."""
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        """Make device `device_index` current."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """Index of the current CUDA device."""
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        """"cuda:<current index>"."""
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """Visible CUDA devices."""
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        """Whether torch sees a CUDA device."""
        return torch.cuda.is_available()

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all kernels on the device."""
        torch.cuda.synchronize(device_index)

    def export_envs(self) -> list[str]:
        """NCCL's settings travel to other nodes."""
        return ["NCCL"]

    def is_bf16_supported(self) -> bool:
        """Whether the GPU computes in bf16."""
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """fp16 tensor cores: compute capability 7.0 or newer (DeepSpeed's rule)."""
        return torch.cuda.get_device_capability()[0] >= 7

    def manual_seed(self, seed: int):
        """Seed the current device's generator."""
        return torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        """Seed every device's generator."""
        return torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        """The current device generator's seed."""
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The RNG state of a device (the current one by default)."""
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a device's RNG state."""
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int):
        """The default generator of a device."""
        return torch.cuda.default_generators[device_index]

    @property
    def Stream(self):  # noqa: N802 - DeepSpeed's name
        """torch.cuda.Stream."""
        return torch.cuda.Stream

    def stream(self, stream):
        """Context that makes `stream` current."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        """The current stream of a device."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        """The default stream of a device."""
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self):  # noqa: N802 - DeepSpeed's name
        """torch.cuda.Event."""
        return torch.cuda.Event

    def empty_cache(self) -> None:
        """Release cached blocks to the driver."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        """Bytes held by tensors now."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None) -> int:
        """Peak bytes held by tensors since the last reset."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        """Start a new allocation peak."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None) -> int:
        """Bytes reserved by the caching allocator (DeepSpeed's old name)."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index=None) -> int:
        """Peak reserved bytes (DeepSpeed's old name)."""
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None) -> None:
        """Start a new reserved peak."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None) -> dict:
        """The caching allocator's statistics."""
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None) -> None:
        """Start new peaks for every memory statistic."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None) -> int:
        """Bytes reserved by the caching allocator."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None) -> int:
        """Peak reserved bytes."""
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index=None) -> int:
        """The device's memory size in bytes."""
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index=None) -> int:
        """Free device memory in bytes, as the driver reports it."""
        return torch.cuda.mem_get_info(device_index)[0]

    def range_push(self, msg: str, domain=None, category=None) -> None:
        """Open an NVTX range (profilers show it)."""
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None) -> None:
        """Close the innermost NVTX range."""
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        """Run `callback` once CUDA is initialised."""
        return torch.cuda._lazy_call(callback)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of a host tensor (fast, asynchronous copies to the GPU)."""
        return tensor.pin_memory()

    def create_graph(self):
        """A CUDA graph to capture into."""
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        """Context capturing the kernels it runs into `graph`."""
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph) -> None:
        """Replay a captured graph."""
        graph.replay()


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
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

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
        """The host allocator keeps no cache of ours."""

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


def _no_ops(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"get_accelerator().{what}: DeepSpeed's compiled-op builders do not exist in zeroshard, "
        "which uses torch's own kernels (zeroshard.ops.adam for Adam); run this part under "
        "DeepSpeed or drop it")


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


@functools.cache
def _accelerator(kind: str) -> DeepSpeedAccelerator:
    return CudaAccelerator() if kind == "cuda" else CpuAccelerator()


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator of this process: DS_ACCELERATOR's choice, else CUDA when torch sees a GPU,
    else the CPU. The same object on every call."""
    chosen = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if chosen:
        if chosen not in _KINDS:
            raise ValueError(f"DS_ACCELERATOR={chosen!r}: zeroshard supports 'cuda' and 'cpu'; "
                             "unset it or choose one of those")
        if chosen == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR='cuda' but torch sees no CUDA device; unset it "
                               "(the CPU is used then) or check the CUDA install")
        return _accelerator(chosen)
    return _accelerator("cuda" if torch.cuda.is_available() else "cpu")


def is_current_accelerator_supported() -> bool:
    """Whether get_accelerator() works here (always: CUDA or the CPU)."""
    return True
