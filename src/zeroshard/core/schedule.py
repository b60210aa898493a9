"""The recorded order in which stage-3 units are needed: drives prefetch and reuse.

The first micro-step that runs a backward is recorded: every time a module asks for its units
(forward pre-hook, or the pre-backward hook on its outputs) the unit indices are appended to the
trace. From then on each step walks the same trace with a cursor:

- prefetch: the units after the cursor are gathered ahead of need, up to
  `stage3_prefetch_bucket_size` elements in flight, and never past `stage3_max_live_parameters`
  elements gathered in total;
- reuse: after a module's forward, a unit whose next use lies fewer than
  `stage3_max_reuse_distance` elements of other units ahead is kept gathered (the last block of
  the forward, needed again first in backward, is the typical case), again within the live bound.

Backward order is not assumed to be the reverse of forward: it is recorded like forward.
A step that deviates from the trace (data-dependent control flow) only loses prefetch accuracy;
units are always gathered on demand.
"""

from __future__ import annotations

import itertools


class Schedule:
    """Trace of unit demands for one micro-step, recorded once and then followed."""

    def __init__(self, numel: dict[int, int], reuse_distance: int):
        self.numel = numel  # unit index -> padded elements
        self.reuse_distance = reuse_distance
        self.trace: list[int] = []
        self.recorded: list[int] | None = None
        self.cursor = 0

    @property
    def recording(self) -> bool:
        """True until a whole forward + backward has been traced."""
        return self.recorded is None

    def start_step(self) -> None:
        """A new forward begins (root module's pre-forward outside backward)."""
        self.cursor = 0
        if self.recording:
            self.trace = []

    def demand(self, ids: list[int]) -> None:
        """A module needs `ids` now: append to the trace, or move the cursor past them."""
        if not ids:
            return
        if self.recording:
            self.trace.extend(ids)
            return
        trace = self.recorded
        # Look a little ahead for the demanded units; a miss leaves the cursor where it was.
        for pos in range(self.cursor, min(len(trace), self.cursor + 4 * len(ids) + 8)):
            if trace[pos] == ids[0]:
                self.cursor = pos + len(ids)
                return

    def finish_backward(self) -> None:
        """End of a backward: the first complete trace becomes the schedule."""
        if self.recording and self.trace:
            self.recorded = self.trace
            self.trace = []

    def upcoming(self):
        """Unit indices expected next, in order (nothing while recording)."""
        if self.recorded is None:
            return iter(())
        return itertools.islice(self.recorded, self.cursor, None)

    def reuse_soon(self, index: int) -> bool:
        """Whether unit `index` is needed again within `reuse_distance` elements of other units."""
        if self.recorded is None or self.reuse_distance <= 0:
            return False
        between = 0
        for upcoming in itertools.islice(self.recorded, self.cursor, None):
            if upcoming == index:
                return True
            between += self.numel[upcoming]
            if between >= self.reuse_distance:
                return False
        return False
