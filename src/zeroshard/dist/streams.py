"""Side streams and events through torch's device-generic API (`torch.Stream`, `torch.Event`,
`torch.accelerator`); on CPU every stream is None and every call here does nothing, so the same
code runs (in program order) where there is no accelerator.

Ordering rule used everywhere: work moved to a side stream first waits for an event recorded on
the stream that produced its input; a consumer on the compute stream waits for an event recorded
on the side stream after the work. Memory handed between streams is kept referenced by its owner
until that consumer's event, never freed early, so no `record_stream` is needed; where a buffer
made on a side stream is dropped right after the current stream reads it (qwZ's packed rows,
decoded once gathered: `core/zeropp/collectives.py`), `keep_until_used` tells the allocator.
"""

from __future__ import annotations

import contextlib

import torch


#: The step's side streams: gradient landings (stages 2-3), stage-3 gathers, read-ahead copies of
#: offloaded parameter shards to the device.
STEP_STREAMS = ("reduce", "gather", "h2d")


class Streams:
    """The side streams and events of one engine's step on one device, made once by `build.py`
    and handed to every part that queues work off the compute stream (the stage policy, the
    parameter store, the optimizer placement): one owner, one place to test the ordering."""

    def __init__(self, device: torch.device, names: tuple[str, ...] = STEP_STREAMS):
        self.device = device
        #: Real streams only on an accelerator; None on CPU.
        self.active = device.type != "cpu" and hasattr(torch, "Stream")
        self.side = {name: torch.Stream(device) if self.active else None for name in names}

    def stream(self, name: str):
        """The side stream `name` (None on CPU)."""
        return self.side[name]

    def record(self, stream=None):
        """An event recorded now on `stream` (default: the current stream); None on CPU."""
        if not self.active:
            return None
        event = torch.Event(self.device)
        event.record(stream if stream is not None else torch.accelerator.current_stream(self.device))
        return event

    def wait(self, event, stream=None) -> None:
        """Make `stream` (default: the current stream) wait for `event`, without the host waiting."""
        if event is None:
            return
        (stream if stream is not None else torch.accelerator.current_stream(self.device)).wait_event(event)

    def keep_until_used(self, tensor: torch.Tensor) -> None:
        """`tensor` was made on a side stream and is read by work queued now on the current
        stream: its memory is not handed out again before that work has run, even if the last
        reference goes first (the caching allocator's `record_stream`; nothing on CPU)."""
        if self.active and tensor.device.type != "cpu":
            tensor.record_stream(torch.accelerator.current_stream(self.device))

    @contextlib.contextmanager
    def on(self, name: str):
        """Run the block on side stream `name`, after what the current stream has queued so far."""
        side = self.side.get(name)
        if side is None:
            yield
            return
        side.wait_stream(torch.accelerator.current_stream(self.device))
        with side:
            yield
