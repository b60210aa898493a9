"""What DeepSpeed's CPU and CUDA accelerators share (accelerator.py picks one): tensor helpers,
RNG, host-timer questions, the compile backend, and no compiled-op builders."""

from __future__ import annotations

import functools

import torch

__all__ = ["DeepSpeedAccelerator"]


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


def _no_ops(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"get_accelerator().{what}: DeepSpeed's compiled-op builders do not exist in zeroshard, "
        "which uses torch's own kernels (zeroshard.ops.adam for Adam); run this part under "
        "DeepSpeed or drop it")
