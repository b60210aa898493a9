"""Turning desynchronised ranks into a readable error instead of a hang or silent corruption.

At stage 3 every rank must gather and reduce-scatter the same units in the same order. If one rank
takes a different path through the model (data-dependent control flow), its collectives pair with
the wrong collectives of its peers: units of equal size silently exchange each other's data,
different sizes hang until the process-group timeout (30 minutes by default).

So before each stage-3 collective every rank contributes a tag (what it is about to do: gather,
reduce-scatter or step, which unit, a running count) to a tiny all-gather on a side gloo group whose
timeout is `zero_optimization.zeroshard_desync_timeout` seconds. Equal tags: go on. Different
tags: every rank raises `DesyncError` naming what each rank was doing. A peer that never arrives
(it left the stage-3 path altogether): the wait times out and the rank raises the same error
saying who was missing. Cost: one 24-byte all-gather per unit collective; 0 disables the check.
"""

from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist

from ..comm import _ALL_GATHER, Comm

KINDS = ("gather", "reduce-scatter", "optimizer step")


class DesyncError(RuntimeError):
    """Ranks disagreed about the next stage-3 collective (different control flow on some rank)."""


class OrderGuard:
    """Compares each rank's next stage-3 collective before it is issued."""

    def __init__(self, comm: Comm, timeout_s: float, describe):
        self.comm = comm
        self.describe = describe  # unit index -> readable description
        self.timeout_s = timeout_s
        self.enabled = comm.world_size > 1 and timeout_s > 0
        self.count = 0
        # The side group's one strong reference; the finalizer destroys the group (joining its
        # worker threads) when the guard goes away or, at the latest, at interpreter exit: a gloo
        # thread still alive while Python finalizes can abort the process (see comm.py).
        self._group: list = []
        if self.enabled:
            # Every rank creates the side group at the same point of engine construction.
            self._group.append(dist.new_group(backend="gloo", ranks=list(range(comm.world_size))
                                              if comm.group is None else comm._ranks,
                                              timeout=datetime.timedelta(seconds=timeout_s)))
            weakref.finalize(self, _destroy_group, self._group)

    def check(self, kind: str, unit: int = -1) -> None:
        """Raise DesyncError unless every rank is about to do the same (`kind`, `unit`)."""
        if not self.enabled:
            return
        self.count += 1
        # Host tensors on the gloo side group (on GPUs too: a CPU round trip, no device sync).
        mine = torch.tensor([KINDS.index(kind), unit, self.count], dtype=torch.int64, device="cpu")
        every = torch.empty(self.comm.world_size * 3, dtype=torch.int64, device="cpu")
        try:
            _ALL_GATHER(every, mine, group=self._group[0])
        except RuntimeError as err:
            raise DesyncError(
                f"rank {self.comm.rank} waited {self.timeout_s:g}s before its stage-3 collective "
                f"#{self.count} ({self._what(kind, unit)}) and at least one other rank never "
                "reached a stage-3 collective: the ranks took different paths through the model "
                "(data-dependent control flow, an exception on one rank, or a forward without "
                f"backward on some ranks). Underlying error: {str(err).splitlines()[0]}") from None
        rows = every.view(self.comm.world_size, 3).tolist()
        if all(row == rows[0] for row in rows):
            return
        doing = "; ".join(f"rank {r}: {self._what(KINDS[k], u)}" for r, (k, u, _) in enumerate(rows))
        raise DesyncError(
            f"ranks are desynchronised at stage-3 collective #{self.count}: {doing}. Every rank "
            "must run the same modules in the same order each step (no rank-dependent control "
            "flow in forward, the same number of micro-steps, backward on every rank). Nothing "
            "from this step was applied; restart from the last checkpoint.")

    def _what(self, kind: str, unit: int) -> str:
        if unit < 0:
            return kind
        return f"{kind} of {self.describe(unit)}"


def _destroy_group(holder: list) -> None:
    """Destroy the side group in `holder` (if torch still knows it) and drop the reference."""
    if holder and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group(holder[0])
        except (ValueError, RuntimeError):
            pass  # already destroyed with the default group
    holder.clear()
