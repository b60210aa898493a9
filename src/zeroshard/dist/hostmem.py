"""Host memory: where zeroshard keeps what is not on the compute device, and how it says so.

On a GPU the compute device (cuda:LOCAL_RANK) and host memory (CPU RAM, pinned or not) are
different memories: NCCL takes device tensors only, and an op may not mix tensors of both. On a
CPU-only machine they are the same memory, which hides such mistakes. So every tensor the library
places in host memory is allocated here (`host_empty`, `host_zeros`, `host_copy`; `mark_host` for
memory obtained otherwise: a swap file mapped into memory, an aligned staging buffer), and values
cross between the two through `to_host` / `to_device`. The mark lives on the tensor's untyped
storage, so every view carries it, and it goes away with the memory.

Strict host mode (ZEROSHARD_STRICT_HOST=1; tests/conftest.py turns it on for the whole suite)
then behaves like a GPU machine on the CPU:
  - `to_host` / `to_device` are real copies, also when both sides are the CPU;
  - a model handed over on the CPU is host memory (`mark_cpu_as_host`), as on a GPU machine;
  - the collective wrapper (dist/comm.py) refuses a host tensor on the default (NCCL-bound) group;
  - inside the library's host-side code (`host_region()`: the optimizer step, gradient shards
    landing in host memory, checkpoints, initialize) a dispatch mode marks what is computed from
    host memory as host memory (a norm of CPU gradient shards), and refuses an op that mixes host
    and device tensors, which CUDA refuses ("Expected all tensors to be on the same device").
Outside strict mode nothing is checked and `host_region()` is a no-op.

`byte_view` exposes a CPU tensor's bytes to Python's buffer protocol (file writes, `os.preadv` /
`os.pwritev`) without a copy. torch's own route to a buffer, `Tensor.numpy()`, needs NumPy, which
zeroshard does not depend on: a bare install must run every path, NVMe offload and safetensors
output included.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

from .hostpolicy import HOST_ATTR, HostMemoryError, call_site, is_host, strict_host

__all__ = ["HostMemoryError", "byte_view", "host_copy", "host_empty", "host_region", "host_zeros",
           "is_host", "mark_cpu_as_host", "mark_host", "on_device", "return_freed_memory",
           "strict_host",
           "to_device", "to_host"]


def _pin(pin: bool) -> bool:
    return pin and torch.cuda.is_available()


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Record that `tensor`'s memory (every view of it) is host memory; returns `tensor`."""
    setattr(tensor.untyped_storage(), HOST_ATTR, True)
    return tensor


def host_empty(shape, dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """An uninitialised tensor in host memory (page-locked on CUDA machines when `pin`)."""
    return mark_host(torch.empty(shape, dtype=dtype, device="cpu", pin_memory=_pin(pin)))


def host_zeros(shape, dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """A zeroed tensor in host memory (page-locked on CUDA machines when `pin`)."""
    return mark_host(torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=_pin(pin)))


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None, pin: bool = False) -> torch.Tensor:
    """A new host tensor holding `tensor`'s values (cast to `dtype`): always a copy of its own,
    complete on return (the host may read it at once)."""
    return host_empty(tensor.shape, dtype or tensor.dtype, pin).copy_(tensor)


def to_host(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor`'s values in host memory, for immediate use: itself when it is there already (or,
    outside strict mode, when the compute device is the CPU and no cast is needed)."""
    dtype = dtype or tensor.dtype
    if is_host(tensor) and tensor.dtype == dtype:
        return tensor
    if tensor.device.type == "cpu" and not strict_host():
        return tensor.to(dtype)
    return host_copy(tensor, dtype)


def to_device(tensor: torch.Tensor, device: torch.device, non_blocking: bool = True) -> torch.Tensor:
    """`tensor` on the compute device: a copy when it is in host memory (in strict mode also
    when the device is the CPU); non-blocking from pinned memory unless `non_blocking` is false
    (the host memory is reused at once)."""
    if strict_host() and is_host(tensor):
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        return out.copy_(tensor)
    non_blocking = non_blocking and tensor.device.type == "cpu" and tensor.is_pinned()
    return tensor.to(device, non_blocking=non_blocking)


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` is in `device`'s memory (in strict mode a host tensor never is)."""
    return tensor.device == device and not (strict_host() and is_host(tensor))


def mark_cpu_as_host(tensor: torch.Tensor) -> torch.Tensor:
    """Strict mode: a CPU tensor handed to zeroshard (a model built on the CPU) is host memory,
    as it is on a GPU machine, so it must be moved before any collective. No-op otherwise."""
    if strict_host() and tensor.device.type == "cpu" and tensor.untyped_storage().nbytes():
        mark_host(tensor)
    return tensor


def host_region():
    """Context for the library's host-side code: in strict mode results computed from host
    memory are marked as host memory and ops mixing host and device tensors are refused."""
    if not strict_host() or any(isinstance(m, _HostTracker) for m in _get_current_dispatch_mode_stack()):
        return contextlib.nullcontext()
    return _HostTracker()


# Ops that move values between memories: the one place host and device tensors may meet.
_TRANSFERS = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default,
              torch.ops.aten.copy.default, torch.ops.aten._copy_from.default,
              torch.ops.aten._copy_from_and_resize.default}


class _HostTracker(TorchDispatchMode):
    """Strict mode only: propagates host marks through ops and refuses host/device mixes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":  # collectives: dist/comm.py checks them
            return func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        hosted = [is_host(t) for t in inputs]
        if any(hosted) and func not in _TRANSFERS:
            # CUDA lets a 0-dim CPU tensor join a device op (a "CPU scalar"), nothing else.
            if any(h and t.dim() for t, h in zip(inputs, hosted)) and \
                    any(not h and t.dim() for t, h in zip(inputs, hosted)):
                raise HostMemoryError(
                    f"strict host mode: {func} at {call_site(('hostmem.py',))} mixes tensors in "
                    "host memory (offloaded masters or state, CPU gradient shards, staging "
                    "buffers) with compute-device tensors; on a GPU this fails (\"Expected all "
                    "tensors to be on the same device\"). Copy across explicitly with "
                    "dist/hostmem.py to_host / to_device.")
        out = func(*args, **kwargs)
        if any(hosted) and func is not torch.ops.aten.copy_.default:
            for result in tree_leaves(out):
                if isinstance(result, torch.Tensor) and result.device.type == "cpu":
                    mark_host(result)
        return out


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_memory() -> None:
    """Hand freed host memory back to the operating system (glibc's malloc_trim).

    glibc keeps freed blocks of a few MiB in its heap, and a sequence like "build a module's
    weights, keep a 1/N shard, free the weights" leaves a hole per module that the next module's
    weights do not fill (measured: 16 MiB of resident memory per Linear(2048, 2048) kept after
    it was partitioned, and exactly the shards with a trim after each). Called after each
    module or unit is partitioned; a few ms each.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes, sharing its memory."""
    if tensor.device.type != "cpu":
        raise ValueError(f"byte_view needs a CPU tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw._tensor = tensor  # the view keeps `raw` alive, `raw` keeps the tensor's memory alive
    return memoryview(raw).cast("B")
