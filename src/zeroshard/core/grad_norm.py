"""The global gradient norm of the last applied step, as `engine.get_global_grad_norm()` reports it.

A step forms the norm when it needs it: clipping, loss scaling and bf16's overflow skip read it,
and so do stages 1-3 (its all-reduce carries the step counts). Stage 0 without any of those forms
none (DDP forms none either: a pass over every gradient is about 1.3% of a CPU step). Its norm is
then formed when first asked for, from the gradients the step read, as long as no backward has
written over them since (the policy's `grad_token` tells); asked too late, the answer is None
rather than another step's norm. A caller that asked once is taken to want it every step: from
then on each step forms it before stepping, so the answer never comes too late again.
"""

from __future__ import annotations

import torch

from ..dist import Comm
from ..dist.hostmem import host_empty, is_host, to_device
from . import step_check


def norm_and_flag(opt, grads: list[torch.Tensor], scale: float):
    """The step's unclipped global gradient norm (a device tensor; None where the step forms
    none), its inf/nan flag (0-dim float32) and every rank's step counts (None: not carried), for
    the ZeroOptimizer `opt` stepping `grads` under the loss `scale`."""
    needs_norm = opt.clip_norm > 0 or opt.scaler.enabled or opt.skip_nonfinite \
        or opt.muon is not None or opt.norm.wanted
    verdict = None if needs_norm else opt.policy.loss_verdict()
    if verdict is None:
        total, counts = global_sq_norm(opt.placement.sq_norm(grads), opt.comm, opt.device,
                                       opt.policy.shards_optimizer)
        norm, found_inf = total.sqrt() / scale, (~torch.isfinite(total)).to(torch.float32)
    else:  # stage 0 without clipping or loss scaling: the losses' check (step_check.LossCheck)
        opt.placement.sq_norm(grads, norm=False)
        counts, norm, found_inf = None, None, verdict.to(opt.device)  # (a loss elsewhere)
    if counts is None:  # stage 0: the counts came with the gradients' last all-reduce
        counts = opt.policy.received_counts()
    return norm, found_inf, counts


def global_sq_norm(local: torch.Tensor, comm: Comm, device: torch.device,
                   sharded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sum of squares of the (still scaled) gradient over all shards of all ranks, a 0-dim
    float64 tensor on the compute `device`, from this rank's sum `local` (float64, shape [1], in
    host memory under optimizer offload); and every rank's step counts, which the all-reduce
    carries after the sum (`step_check.py`; None when there is no all-reduce: `sharded` false,
    every rank stepped everything)."""
    if not sharded:
        return local.reshape(()), None
    extra = step_check.tail_numel(comm.world_size)
    if extra:  # the counts join the sum where it is (host memory under offload)
        both = host_empty(1 + extra, torch.float64) if is_host(local) else \
            torch.empty(1 + extra, dtype=torch.float64, device=local.device)
        both[:1].copy_(local.reshape(1))
        step_check.write_counts(both[1:], comm.rank)
        local = both
    local = to_device(local, device)  # NCCL takes device tensors only
    comm.all_reduce(local, checked=extra)
    return local[0], (local[1:] if extra else None)


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `tensors`, a 0-dim float64 tensor (on
    `device` when there are none). `_foreach_norm` reduces without materialising squared copies,
    accumulating in fp32 (bf16 gradients lose no precision to it)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).double().pow(2).sum()


class StepNorm:
    """The last applied step's norm: a device tensor, or the gradients to form it from."""

    def __init__(self, device: torch.device):
        """No step yet; `device`: the compute device."""
        self.device = device
        self.value: torch.Tensor | None = None  # 0-dim, on the compute device; never read early
        self.later: tuple[list[torch.Tensor], int | None] | None = None
        #: The norm was asked for after a step that formed none: every step forms it now.
        self.wanted = False

    def formed(self, norm: torch.Tensor | None, grads: list[torch.Tensor], token) -> None:
        """An applied step: its `norm`, or (None) its gradients and the policy's token then."""
        self.value = norm
        self.later = (grads, token) if norm is None else None

    def drop(self) -> None:
        """A skipped step: no norm to report."""
        self.value = self.later = None

    def tensor(self, token_now) -> torch.Tensor | None:
        """The norm as a device tensor (formed now if the step deferred it and its gradients
        are still unwritten: `token_now` equals the step's), or None."""
        if self.value is None and self.later is not None:
            self.wanted = True
            grads, token = self.later
            self.later = None
            if token == token_now:
                self.value = sum_of_squares(grads, self.device).sqrt()
        return self.value
