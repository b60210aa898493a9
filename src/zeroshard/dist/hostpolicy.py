"""Strict host mode (`ZEROSHARD_STRICT_HOST=1`, on for the whole test suite): every tensor
zeroshard places in host memory carries a mark on its storage (`dist/hostmem.py` sets it), and a
`Comm` on the default group, which is NCCL on GPUs and takes device tensors only, refuses a
marked tensor, naming the call site. So on a CPU-only machine, where host and device are the same
memory, a host tensor reaching an NCCL collective is still an error."""

from __future__ import annotations

import os

import torch

#: Environment switch of strict host mode ("1" on).
STRICT_HOST_ENV = "ZEROSHARD_STRICT_HOST"
#: Attribute set on the untyped storage of every tensor zeroshard placed in host memory.
HOST_ATTR = "_zeroshard_host"


class HostMemoryError(RuntimeError):
    """Strict host mode: host memory went where only compute-device memory may go."""


def strict_host() -> bool:
    """Whether strict host mode is on (ZEROSHARD_STRICT_HOST=1)."""
    return os.environ.get(STRICT_HOST_ENV, "0") == "1"


def is_host(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory was placed in host memory by zeroshard (any view of it)."""
    return bool(getattr(tensor.untyped_storage(), HOST_ATTR, False))


def call_site(skip_files: tuple[str, ...]) -> str:
    """`file.py:123 (function)` of the innermost frame outside `skip_files` and torch."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-1]):
        name = os.path.basename(frame.filename)
        if name not in skip_files and f"{os.sep}torch{os.sep}" not in frame.filename:
            return f"{name}:{frame.lineno} ({frame.name})"
    return "<unknown>"
