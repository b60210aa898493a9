"""DeepSpeed's accelerator interface, `deepspeed.accelerator.get_accelerator()`, for CPU and CUDA
(cuda.py, cpu.py; what they share in base.py).

DeepSpeed's examples reach the device through this object instead of `torch.cuda`
(`get_accelerator().device_name(local_rank)`, `.synchronize()`, `.memory_allocated()`, ...), so
a script written for DeepSpeed runs here unchanged. `get_accelerator()` picks CUDA when torch
sees a GPU and the CPU otherwise, or what `DS_ACCELERATOR` ("cuda" / "cpu") names, as DeepSpeed.

DeepSpeed's compiled-op builders (`create_op_builder`, ...) do not exist here.
"""

from __future__ import annotations

import functools
import os

import torch

from .base import DeepSpeedAccelerator
from .cpu import CpuAccelerator, CpuEvent, CpuStream
from .cuda import CudaAccelerator

__all__ = ["CpuAccelerator", "CpuEvent", "CpuStream", "CudaAccelerator", "DeepSpeedAccelerator",
           "get_accelerator", "is_current_accelerator_supported"]

_KINDS = ("cuda", "cpu")


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
