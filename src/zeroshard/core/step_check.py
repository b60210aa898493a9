"""Every rank's step counts, carried inside a collective the step makes anyway, compared after it.

A rank that skips `engine.step()` (or `engine.backward()`) once goes on issuing the same
collectives as its peers, one step apart: at stage 0 (all-reduce) and on NCCL at any stage
(no point-to-point tags there) they still pair up, and the replicas silently drift apart. So each
rank writes its counts (optimizer steps, backward passes: `dist.process_group.step_counts`) into
a few extra elements at the end of a collective it issues in every step, as a SUM reduction:
rank r fills slots `[2r, 2r+1]` and leaves the others zero, so after the sum every rank holds every
rank's counts. Sums of one value and zeros are exact in any float dtype as long as the value is
below 2^(mantissa bits + 1), hence counts are taken modulo that (2^24 in fp32; a rank that is off
by exactly that many steps goes unseen).

Which collective carries them: stage 0, the last gradient all-reduce of each reduction round (the
end of the bucket whose buffer has room for them, so no collective is added); stages 1-3, the
scalar all-reduce of the gradient norm (float64). The comparison is one device op; its result
rides on the step's one host read (the non-finite flag, `dist/hostsync.py`), masks the step inside the
fused kernels like an overflow would, and then raises `DesyncError` on every rank, naming each
rank's counts. The extra elements are counted in the comm ledger as "step_check", apart from the
gradient bytes.

Stage 0 also carries one more element after the counts: the sum of the ranks' "a loss of this
window was inf/nan" flags (`LossCheck`). It is stage 0's inf/nan guard when the step needs no
gradient norm (no clipping, no loss scaling): DDP computes no norm, and a pass over every gradient
to find one would cost stage 0 its parity with DDP (about 1.3% of a step on the CPU bench).
"""

from __future__ import annotations

import torch

from ..dist.process_group import step_counts
from ..dist.steps import DesyncError, describe_step_counts

#: Elements per rank: optimizer steps, backward passes.
COUNT_SLOTS = 2


def tail_numel(world_size: int) -> int:
    """Extra elements a collective carries for the check (none for one rank)."""
    return COUNT_SLOTS * world_size if world_size > 1 else 0


def exact_limit(dtype: torch.dtype) -> int:
    """The integers below this are exact in `dtype` (counts are sent modulo it)."""
    return int(round(2.0 / torch.finfo(dtype).eps))


def write_counts(tail: torch.Tensor, rank: int) -> None:
    """Fill `tail` (`tail_numel` elements) with this rank's counts in its slots, zeros elsewhere
    (device ops with host scalars: no synchronization)."""
    limit = exact_limit(tail.dtype)
    tail.zero_()
    for i, count in enumerate(step_counts()):
        tail[COUNT_SLOTS * rank + i].fill_(count % limit)


def disagree(summed: torch.Tensor, rank: int) -> torch.Tensor:
    """A 0-dim float32 device tensor: 1 when another rank's counts differ from this rank's."""
    counts = summed.view(-1, COUNT_SLOTS)
    return (counts != counts[rank]).any().to(torch.float32)


def check(values: list[float]) -> None:
    """Raise DesyncError naming every rank's counts unless all ranks' `values` (the summed tail,
    read on the host) agree."""
    counts = [tuple(int(v) for v in values[i:i + COUNT_SLOTS])
              for i in range(0, len(values), COUNT_SLOTS)]
    if len(set(counts)) > 1:
        raise DesyncError(f"ranks are desynchronised: {describe_step_counts(counts)}. Caught at "
                          "the first collective after the skip (the counts travel in it); this "
                          "step was not applied. Restart from the last checkpoint")


class LossCheck:
    """Stage 0's inf/nan guard without a pass over the gradients: every rank notes the losses it
    runs backward on (`engine.backward`), and the verdict, whether any rank's loss in the window
    was inf/nan, rides in the tail of the last gradient all-reduce after the step counts."""

    def __init__(self, world_size: int):
        """One rank's notes; `world_size` decides whether a collective carries them."""
        self.carried = world_size > 1
        self.zero_grad()

    def zero_grad(self) -> None:
        """A new accumulation window: nothing noted, nothing received."""
        #: None: no backward noted; True: every backward's loss noted; False: one was not seen.
        self.seen: bool | None = None
        self.bad: torch.Tensor | None = None  # 0-dim float32 device flag, the window's losses
        self.notes = 0
        self.sent = 0  # notes covered by the tail last written
        self.received: tuple[int, torch.Tensor] | None = None  # (notes covered, summed flag)

    def note(self, loss: torch.Tensor | None) -> None:
        """A backward of `loss` begins (None: a backward whose loss this rank does not see)."""
        if loss is None:
            self.seen = False
            return
        bad = (~torch.isfinite(loss.detach())).to(torch.float32).reshape(())
        self.bad = bad if self.bad is None else torch.maximum(self.bad, bad)
        self.notes += 1
        if self.seen is None:
            self.seen = True

    def slots(self) -> int:
        """Elements the check adds after the step counts (none for one rank)."""
        return 1 if self.carried else 0

    def write(self, slot: torch.Tensor) -> None:
        """Fill the one element `slot` with this rank's flag (a device op)."""
        if self.bad is None:
            slot.zero_()
        else:
            slot.copy_(self.bad.reshape(slot.shape))
        self.sent = self.notes

    def land(self, summed: torch.Tensor) -> None:
        """The all-reduced element: every rank's flags summed."""
        self.received = (self.sent, summed.clone())

    def verdict(self) -> torch.Tensor | None:
        """A 0-dim float32 flag (1: some rank's loss was inf/nan) when every backward of the
        window noted its loss and the flags of all of them were exchanged; None otherwise (the
        caller then checks the gradients themselves)."""
        if not self.seen:
            return None
        if not self.carried:
            return self.bad
        if self.received is None or self.received[0] != self.notes:
            return None
        return (self.received[1].reshape(()) > 0).to(torch.float32)


class CarriedChecks:
    """What stage 0's last gradient all-reduce of a step carries after the gradients: every
    rank's step counts, then the losses' inf/nan flag (`LossCheck`)."""

    def __init__(self, world_size: int, rank: int):
        """Nothing received yet."""
        self.rank = rank
        self.count_numel = tail_numel(world_size)
        self.loss = LossCheck(world_size)
        self.counts: torch.Tensor | None = None  # every rank's counts, from the last round

    def numel(self) -> int:
        """Elements carried after the gradients (none for one rank)."""
        return self.count_numel + self.loss.slots()

    def write(self, tail: torch.Tensor) -> None:
        """Fill `tail` (`numel()` elements) with this rank's part (device ops)."""
        write_counts(tail[:self.count_numel], self.rank)
        self.loss.write(tail[self.count_numel:])

    def land(self, tail: torch.Tensor) -> None:
        """The all-reduced `tail`: every rank's counts and flags."""
        self.counts = tail[:self.count_numel].clone()
        self.loss.land(tail[self.count_numel:])

    def zero_grad(self) -> None:
        """A new accumulation window."""
        self.counts = None
        self.loss.zero_grad()
