"""DeepSpeed's CUDA accelerator (accelerator.py picks it when torch sees a GPU): every call is
torch.cuda's."""

from __future__ import annotations

import torch

from ....dist.comm import computes_in_fp16
from .base import DeepSpeedAccelerator

__all__ = ["CudaAccelerator"]


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
        return computes_in_fp16(torch.device("cuda", torch.cuda.current_device()))

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
