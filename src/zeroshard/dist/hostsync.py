"""Every point where zeroshard's step makes the host wait for the device goes through here, counted.

On a GPU a host read of a device value (`.item()`, `bool(t)`, a blocking device->host copy) or a
stream/event synchronize stalls the CPU until the GPU has caught up, so the CPU loses its lead
and the GPU then idles while the CPU queues the next kernels. The optimizer step keeps decisions
on the device (clip factor, fp16 overflow and non-finite gradients masked inside torch's fused
optimizer kernels through `found_inf`) and reads back one flag per step, after the whole step is
queued. `HostSyncs` counts each read and wait by reason, so tests can assert how many a step
makes (on CPU, where none of them costs anything, the count is the same as on a GPU).
"""

from __future__ import annotations

from collections import Counter

import torch

from .hostmem import host_copy, host_empty, is_host


class HostSyncs:
    """Counter of host synchronization points, by reason; owned by one optimizer."""

    def __init__(self):
        self.counts: Counter[str] = Counter()

    def read(self, tensor: torch.Tensor, why: str):
        """`tensor`'s value on the host (a Python scalar for one element, else a list)."""
        self.counts[why] += 1
        return tensor.item() if tensor.numel() == 1 else tensor.tolist()

    def start_read(self, tensor: torch.Tensor):
        """Queue a copy of `tensor` into pinned host memory now (non-blocking, on the device's
        current stream) so that `finish_read` later waits only for the work queued before this
        point, not for everything queued meanwhile. On CPU: `tensor` itself."""
        if tensor.device.type == "cpu":
            return tensor, None
        landing = host_empty(tensor.shape, tensor.dtype, pin=True)
        landing.copy_(tensor, non_blocking=True)
        event = torch.Event(tensor.device)
        event.record()
        return landing, event

    def finish_read(self, pending, why: str):
        """The value of a `start_read`, on the host (waits for its copy: counted)."""
        landing, event = pending
        self.counts[why] += 1
        if event is not None:
            event.synchronize()
        return landing.item() if landing.numel() == 1 else landing.tolist()

    def to_host(self, tensor: torch.Tensor, why: str) -> torch.Tensor:
        """`tensor` copied to host memory, complete on return (counted on CPU too)."""
        self.counts[why] += 1
        return tensor if is_host(tensor) else host_copy(tensor)

    def wait(self, event, why: str) -> None:
        """Block the host until `event` (a `torch.Event`, or None: nothing to wait for) is done."""
        self.counts[why] += 1
        if event is not None:
            event.synchronize()

    def total(self) -> int:
        """All host synchronization points counted so far."""
        return sum(self.counts.values())

    def reset(self) -> None:
        """Start counting from zero."""
        self.counts.clear()
