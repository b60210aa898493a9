"""Host memory helpers that need nothing beyond torch and the standard library.

`byte_view` exposes a CPU tensor's bytes to Python's buffer protocol (file writes, `os.preadv` /
`os.pwritev`) without a copy. torch's own route to a buffer, `Tensor.numpy()`, needs NumPy, which
zeroshard does not depend on: a bare install must run every path, NVMe offload and safetensors
output included.
"""

from __future__ import annotations

import ctypes

import torch


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
