"""The CPU optimizer step of each unit, started as soon as its gradient shard is in host memory.

Under `offload_optimizer: cpu` at stages 2-3 the gradient shards land in host memory unit by unit
during the backward that ends an accumulation window. Today's step waits for the end of backward
and then steps every master at once; here one background thread steps each unit as it lands,
while backward goes on on the device (torch's CPU kernels release the GIL).

It is on by default where the compute device is an accelerator (on a CPU-only machine backward
and the step would only share the same cores: measured 9% slower there), or where
`offload_optimizer.zeroshard_step_in_backward` is true, and it is used where it is allowed
(decided at each boundary; otherwise the whole step runs after backward, as before):
  - the engine said this backward ends the accumulation window (`engine.backward`; a plain
    `loss.backward()` loop never steps early, it may accumulate over several);
  - no gradient clipping and no fp16 loss scaling: both need the global norm over all units of
    all ranks, known only after backward, and multiply every gradient by it;
  - the optimizer is one of torch's fused kernels (`Placement.can_mask`): each unit's update is
    skipped inside the kernel where that unit's own gradient shard is inf/nan;
  - a previous backward completed without late gradients (a parameter reused by a later reentrant
    checkpoint backward adds to a shard after it landed: such models keep the after-backward step).

Each unit is stepped by the user's optimizer object over that unit's master alone (a shallow copy
whose param group holds only that master, sharing the state dict), with the hyper-parameters its
group has at that moment: the same kernel on the same elements, so the result is bitwise equal
to stepping all masters at once. `finish()` (called by the step) waits for the thread and
checks that no hyper-parameter changed between backward and step (an LR set in between would
have missed the units already stepped: an error). The updated masters are written back to the
parameters by the step itself, after backward, never while backward may still read them.

Inf/nan: a unit whose shard is not finite on this rank is not updated (the fused kernel masks
it), and the step is refused as before (NonFiniteGradientError). A non-finite gradient at the
model's outputs (a NaN loss) is made every unit's business on every rank: the policy puts a NaN
into every rank's slice of each unit's reduce-scatter buffer (`Stage2._poison`), so no unit is
updated anywhere, as after backward. What remains different: an inf/nan that arises inside
backward with finite output gradients reaches only some shards, and the units of this rank
whose shards were finite are updated before the verdict (`updated()` lists them).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter

import torch

from ..dist.hostmem import host_region


class EarlyStep:
    """One worker thread stepping the masters of landed units, in landing order."""

    def __init__(self, placement):
        self.placement = placement
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        #: Units stepped so far, by "in backward" (handed over as they landed) or "after backward".
        self.counts: Counter[str] = Counter()
        self.reset()

    def reset(self) -> None:
        """Forget the step in progress (its worker must be idle)."""
        #: unit index -> squared-norm inputs of that unit's gradient (float32 norm, 0-dim)
        self.norms: dict[int, torch.Tensor] = {}
        #: unit indices handed to the kernel this step, in order; those whose master had no
        #: state before; unit index -> its own inf/nan flag (1.0: the kernel skipped it)
        self.stepped: list[int] = []
        self.new_state: set[int] = set()
        self.flags: dict[int, torch.Tensor] = {}
        #: group index -> the hyper-parameters each unit of that group was stepped with
        self.hyper: dict[int, list[dict]] = {}
        self.queued = 0
        self.active = False

    # -- called from the backward (main thread) ---------------------------------------------------
    def start(self) -> None:
        """A boundary backward begins stepping units."""
        self.active = True
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="zeroshard-cpu-step", daemon=True)
            self.thread.start()

    def ready(self, unit, grad: torch.Tensor, event=None, landing=None, alpha: float = 1.0,
              when: str = "in backward") -> None:
        """`unit`'s gradient shard `grad` is final for this step: step it on the worker. On an
        accelerator the slice is still on its way: `landing` (pinned) is added into `grad`
        with `alpha` once `event` is done, waited for on the worker."""
        if not self.active:  # the first unit of this step: forget the last one
            self.reset()
            self.start()
        self.queued += 1
        self.counts[when] += 1
        self.jobs.put((unit, grad, event, landing, alpha))

    # -- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            done: threading.Event = job if isinstance(job, threading.Event) else None
            if done is not None:
                done.set()
                continue
            if self.error is not None:
                continue  # after a failure: drain, report it at `finish`
            try:
                with torch.no_grad(), host_region():
                    self._step_unit(*job)
            except BaseException as err:  # reported on the main thread by `finish`
                self.error = err

    def _step_unit(self, unit, grad, event, landing, alpha) -> None:
        if event is not None:
            event.synchronize()  # on this thread: the backward goes on meanwhile
            grad.add_(landing, alpha=alpha)
        placement = self.placement
        master = placement.masters[unit.index]
        g = grad if grad.dtype == master.dtype else grad.to(master.dtype)
        if placement.master_dtype == torch.float32:
            norm = torch._foreach_norm([g])[0]
        else:
            norm = torch._foreach_norm([g], 2, dtype=torch.float32)[0]
        self.norms[unit.index] = norm
        found_inf = (~torch.isfinite(norm)).to(torch.float32)
        optimizer = placement.optimizer
        group = optimizer.param_groups[unit.group_index]
        hyper = {k: v for k, v in group.items() if k != "params"}
        self.hyper.setdefault(unit.group_index, []).append(
            {k: v.clone() if torch.is_tensor(v) else v for k, v in hyper.items()})
        had_state = master in optimizer.state
        # A shallow copy stepping this master alone; its `state` is the optimizer's own dict.
        one = object.__new__(type(optimizer))
        one.__dict__.update(optimizer.__dict__)
        one.__dict__.pop("step", None)  # a wrapper bound to the original (an LR scheduler's)
        one.param_groups = [dict(hyper, params=[master])]
        one.found_inf = found_inf
        master.grad = g
        try:
            one.step()
        finally:
            master.grad = None
        # The flag is not read here (a host read per unit): only a refused step looks at it.
        self.flags[unit.index] = found_inf
        self.stepped.append(unit.index)
        if not had_state:
            self.new_state.add(unit.index)

    def updated(self) -> list[int]:
        """Units whose masters this step updated (their own shard was finite); reads the flags."""
        return [i for i in self.stepped if not self.flags[i].item()]

    # -- called by the step (main thread) ---------------------------------------------------------
    def wait(self) -> None:
        """Block until every unit handed over so far is stepped; re-raise a worker failure."""
        if self.thread is not None and self.thread.is_alive():
            done = threading.Event()
            self.jobs.put(done)
            done.wait()
        if self.error is not None:
            error, self.error = self.error, None
            self.reset()
            raise error

    def finish(self, groups: list[dict]) -> None:
        """Wait for the worker; check that no hyper-parameter changed since units were stepped."""
        self.wait()
        for index, snapshots in self.hyper.items():
            now = {k: v for k, v in groups[index].items() if k != "params"}
            changed = sorted({k for used in snapshots for k in used
                              if not _same(used[k], now.get(k))})
            if changed:
                units = ", ".join(f"u{i}" for i in self.stepped[:4])
                raise RuntimeError(
                    f"param group {index}: {', '.join(changed)} changed between the backward that "
                    f"ended the accumulation window and the optimizer step, but units ({units}, "
                    "...) had already been stepped on the CPU during that backward with the old "
                    "value. Change hyper-parameters before engine.backward (the engine's LR "
                    "scheduler does), or set zero_optimization.offload_optimizer."
                    "zeroshard_step_in_backward to false")

    def close(self) -> None:
        """Stop the worker thread."""
        if self.thread is not None and self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join()
        self.thread = None


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    return a == b
