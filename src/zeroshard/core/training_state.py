"""Where a stage is in the step: an explicit training state that its hooks check and move.

Every stage policy holds one `StepState`. Its `TrainingState` goes

    IDLE --root forward starts--> FORWARD --root forward ends--> IDLE
    IDLE --first gradient hook of a backward--> BACKWARD --end-of-backward callback-->
         POST_BACKWARD --units landed and freed--> IDLE

A backward starts at the first hook that sees it (a gradient of the model's outputs, or a
parameter's gradient), which also queues the end-of-backward callback, once, on autograd's
engine. Hooks assert the states they may run in (`expect`), so a hook firing where the step
does not allow it is an error naming both, not silently wrong gradients. A forward that runs
while the state is BACKWARD is an activation-checkpoint recompute.

`LaunchOrder` is the fixed order in which units' gradient collectives start: a unit launches
once all its gradients are in and every unit before it in the layout has launched, so every rank
issues the same collectives in the same order whatever order autograd visits the units in.
"""

from __future__ import annotations

import enum

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves


class TrainingState(enum.Enum):
    """The phase of the step a stage policy is in."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"  # gradients arriving; units gathered for backward (stage 3)
    POST_BACKWARD = "post-backward"  # the end-of-backward callback: last launches and landings


class StepState:
    """One policy's training state and its end-of-backward callback."""

    def __init__(self, end_of_backward, stage: int):
        """`end_of_backward`: called by autograd once per backward, after its last gradient."""
        self.state = TrainingState.IDLE
        self._end = end_of_backward
        self._stage = stage

    def expect(self, *allowed: TrainingState, what: str) -> None:
        """Raise unless the state is one of `allowed` (`what`: the hook or call checking)."""
        if self.state not in allowed:
            names = " or ".join(s.value for s in allowed)
            raise RuntimeError(
                f"stage {self._stage}: {what} ran while the step was in state "
                f"{self.state.value!r}, expected {names}; a forward, backward or step was cut "
                "short or called out of order (an exception caught inside backward?) - call "
                "optimizer.zero_grad() (or engine.step()) to start the next step cleanly")

    @property
    def in_backward(self) -> bool:
        """Whether a backward of this policy's model is running (a forward now is a recompute)."""
        return self.state in (TrainingState.BACKWARD, TrainingState.POST_BACKWARD)

    def begin_forward(self) -> None:
        """The root module's forward starts (outside a backward)."""
        # A forward that raised left FORWARD behind: the next one simply starts over.
        self.expect(TrainingState.IDLE, TrainingState.FORWARD, what="the model's forward")
        self.state = TrainingState.FORWARD

    def end_forward(self) -> None:
        """The root module's forward returned."""
        if self.state is TrainingState.FORWARD:
            self.state = TrainingState.IDLE

    def begin_backward(self, _grad=None) -> None:
        """A hook saw a gradient: the first one of a backward queues the end-of-backward
        callback (usable directly as a tensor hook)."""
        if self.state is TrainingState.BACKWARD:
            return
        self.expect(TrainingState.IDLE, TrainingState.FORWARD, what="a gradient hook")
        self.state = TrainingState.BACKWARD
        Variable._execution_engine.queue_callback(self._run_end)

    def _run_end(self) -> None:
        self.state = TrainingState.POST_BACKWARD
        try:
            self._end()
        finally:
            self.state = TrainingState.IDLE

    def reset(self) -> None:
        """Forget a step cut short (before loading a checkpoint, after an error)."""
        self.state = TrainingState.IDLE


def hook_outputs(output, hook) -> None:
    """Register `hook` on every output tensor of a forward that will get a gradient."""
    if torch.is_grad_enabled():
        for leaf in tree_leaves(output):
            if torch.is_tensor(leaf) and leaf.requires_grad:
                leaf.register_hook(hook)


class LaunchOrder:
    """Which units' gradients are complete, and which of them may start their collective."""

    def __init__(self, units):
        """`units`: in the layout's gradient-ready order (the order collectives start in)."""
        self.units = units
        self.clear()

    def clear(self) -> None:
        """A new backward: every unit waits for all its gradients again."""
        self.missing = {u.index: len(u.slots) for u in self.units}
        self.launched: set[int] = set()
        self.next = 0

    def arrived(self, unit) -> None:
        """One more gradient of `unit` is in."""
        self.missing[unit.index] -= 1

    def complete(self, unit) -> bool:
        """Whether all of `unit`'s gradients are in."""
        return self.missing[unit.index] <= 0

    def ready(self, force: bool = False):
        """Yield, in layout order, the units that may launch now (the caller's launch marks each
        in `launched`, as a launch out of this order does); `force`: every remaining one (end of
        backward: missing gradients count as zeros)."""
        while self.next < len(self.units):
            unit = self.units[self.next]
            if self.missing[unit.index] > 0 and not force:
                return
            self.next += 1
            if unit.index not in self.launched:
                yield unit
