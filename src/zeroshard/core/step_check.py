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
