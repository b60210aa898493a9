"""Where the fp32 master shards and the optimizer state live: the device, CPU memory (ZeRO-Offload)
or NVMe files (ZeRO-Infinity).

Offload is a placement, not a layout: every unit still has one fp32 master for the slice this
rank owns and one optimizer state tensor per kind (exp_avg, exp_avg_sq, ...) of the same length.
`master_dtype` bf16 (DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states) keeps the
masters, the gradients the optimizer reads and so the state (torch optimizers make it in the
master's dtype) in bf16: 2 + 4 bytes per parameter with Adam instead of 4 + 8 (device and CPU
placements; the NVMe swap files stay fp32).

Step plan, after the policy has averaged the gradients:
  device: the master is the owned slice itself in fp32 (no copy) or an fp32 copy beside it; the
    torch optimizer steps all masters at once (fused CPU kernel where torch has one); each master
    is copied back into the compute-dtype owned slice.
  cpu: the same, with masters and state in CPU memory (pinned on CUDA when `pin_memory`): each
    unit's gradient shard is copied to CPU in fp32 (non-blocking into pinned buffers on CUDA,
    waited for once through an event), the step runs on the CPU with `cores / local ranks`
    threads, and the updated master goes back to the device in the compute dtype. The clip factor
    and overflow flag, computed on the device, come to the host once per step with them.
    At stages 2-3, where nothing global is needed first (no clipping, no fp16 loss scaling), each
    unit is instead stepped on a CPU thread as soon as its gradient shard lands during the
    boundary backward (`early.py`; on by default with an accelerator); the step then only waits
    for that thread and writes the masters back.
  nvme: masters and state in swap files, stepped unit by unit (`nvme_optimizer.py`).
`placements.make_placement` picks one from the config.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ..dist.hostmem import host_copy, host_empty, host_zeros, is_host, on_device, to_host
from ..dist.hostsync import HostSyncs
from ..core.grad_norm import sum_of_squares
from ..core.layout import Unit
from ..dist.streams import Streams
from .early import EarlyStep

# torch optimizers whose fused kernels skip the update where `optimizer.found_inf` is 1.
_TAKES_FOUND_INF = {"Adam", "AdamW", "SGD", "Adagrad"}
# torch optimizers given `fused=True` when the user left it unset.
_FUSED_ON_CPU = {"Adam", "AdamW", "SGD", "Adagrad"}


class Placement:
    """Masters and optimizer state held in memory (on the compute device or on the CPU)."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: list[Unit],
                 owned: list[torch.Tensor], compute_dtype: torch.dtype | None, where: str = "device",
                 pin: bool = False, master_dtype: torch.dtype = torch.float32,
                 step_in_backward: bool | None = False, *, syncs: HostSyncs | None = None,
                 clip_norm: float = 0.0, loss_scaling: bool = False, streams: Streams):
        """Take a master of each unit's owned slice (`owned`, in full precision, before the units
        are cast), re-seat `optimizer` on the masters, and decide whether units may be stepped
        during the boundary backward (`early.py`; never with clipping or fp16 loss scaling).
        `streams`: the step's side streams (the builder's one `Streams`)."""
        self.optimizer = optimizer
        self.units = units
        self.name = where
        if step_in_backward is None:  # by default where there is a device to overlap with
            step_in_backward = any(u.compute_device.type != "cpu" for u in units)
        self.step_in_backward = step_in_backward and where == "cpu"
        #: The per-unit CPU step during backward (`early.py`), when this run allows it,
        #: and whether the last step was taken that way.
        self.early: EarlyStep | None = None
        self.stepped_early = False
        self.device = torch.device("cpu") if where != "device" else None
        self.pin = pin and where != "device" and torch.cuda.is_available()
        self.master_dtype = master_dtype
        self.masters = [self._master(unit, slice_, compute_dtype)
                        for unit, slice_ in zip(units, owned)]
        reseat(optimizer, units, self.masters)
        on_cuda = any(u.compute_device.type == "cuda" for u in units)
        # Pinned landing buffers (in the master dtype) make the gradient copy to the CPU asynchronous.
        self.grad_buffers = [host_empty(m.numel(), m.dtype, pin=True) for m in self.masters] \
            if self.pin and on_cuda else None
        self.threads = _offload_threads() if where != "device" and on_cuda else None
        #: Host synchronization points (the optimizer's counter).
        self.syncs = syncs if syncs is not None else HostSyncs()
        self.streams = streams
        if self.step_in_backward and clip_norm <= 0 and not loss_scaling and self.can_mask():
            self.early = EarlyStep(self)

    def _master(self, unit: Unit, owned: torch.Tensor,
                compute_dtype: torch.dtype | None) -> nn.Parameter:
        owned = owned.detach()
        in_fp32 = (compute_dtype or unit.dtype) == torch.float32 == self.master_dtype
        if self.device is not None:  # offloaded: in host memory
            return nn.Parameter(host_copy(owned, self.master_dtype, self.pin), requires_grad=True)
        if in_fp32 and on_device(owned, unit.compute_device):
            return nn.Parameter(owned, requires_grad=True)  # the master *is* the owned slice
        # On the device, where the gradients are, also when the parameter shard itself is in
        # host memory (offload_param without offload_optimizer). A bf16 master is a copy too: the
        # owned slice is re-allocated when the unit is cast.
        data = torch.empty(owned.numel(), dtype=self.master_dtype, device=unit.compute_device)
        data.copy_(owned)
        return nn.Parameter(data, requires_grad=True)

    def _early_now(self) -> bool:
        return self.early is not None and self.early.active

    # -- the step ----------------------------------------------------------------------------------
    def sq_norm(self, grads: list[torch.Tensor], norm: bool = True) -> torch.Tensor | None:
        """Attach gradients (in the masters' dtype) to the masters; return the local sum of their
        squares (float64), or None with `norm` false (attached only: the step needs no norm)."""
        if self._early_now():
            return self._early_sq_norm(grads)
        fp32 = []
        copied = False
        for i, (master, grad) in enumerate(zip(self.masters, grads)):
            if self.grad_buffers is not None and grad.device.type == "cuda":
                g = self.grad_buffers[i].copy_(grad, non_blocking=True)
                copied = True
            elif self.device is not None:
                copied |= not is_host(grad)
                g = to_host(grad, master.dtype)  # stage 1: from the device's gradient buffers
            else:
                g = grad.to(master.device, master.dtype)
            master.grad = g
            fp32.append(g)
        if copied:  # the CPU reads them next: wait once for every copy queued above
            self.syncs.wait(self.streams.record(), "offload: gradients reach host memory")
        if not norm:
            return None
        if not fp32:
            return host_zeros(1, torch.float64)
        return sum_of_squares(fp32, fp32[0].device).reshape(1)

    def _early_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Units were stepped during backward: wait for them (stepping any that did not land,
        the same way) and sum the squares of the norms the worker took, in unit order."""
        early = self.early
        early.wait()
        for unit, grad in zip(self.units, grads):
            if unit.index not in early.norms:
                early.ready(unit, grad, when="after backward")
        early.finish(self.optimizer.param_groups)
        if not self.units:
            return host_zeros(1, torch.float64)
        norms = [early.norms[u.index] for u in self.units]
        return torch.stack(norms).double().pow(2).sum().reshape(1)

    def can_mask(self) -> bool:
        """Whether the step can take an overflow flag as a tensor: torch's own fused kernels only
        (a subclass or another optimizer might ignore `found_inf` and apply an inf/nan step)."""
        opt = type(self.optimizer)
        return opt.__module__.startswith("torch.optim") and opt.__name__ in _TAKES_FOUND_INF \
            and all(group.get("fused") for group in self.optimizer.param_groups)

    def step(self, factor, found_inf: torch.Tensor | None, write_owned) -> set[int]:
        """Scale the attached gradients by `factor` (a float, or a 0-dim tensor), step (skipped
        inside the kernels where `found_inf` is 1), and write masters back to the params through
        `write_owned(unit, values)` (the policy's). Returns the ids of the masters that had
        optimizer state before (see `forget_new_state`)."""
        self.stepped_early = self._early_now()
        if self.stepped_early:
            return self._finish_early(factor, write_owned)
        factor, found_inf = self._for_step(factor, found_inf)
        grads = [m.grad for m in self.masters if m.grad is not None]
        grad_scale = None
        if found_inf is not None and grads and (torch.is_tensor(factor) or factor != 1.0) \
                and all(g.dtype == torch.float32 for g in grads):
            # torch's fused kernels (the only ones handed found_inf) divide fp32 gradients by
            # `grad_scale` as they read them, exactly as `_scale` would before: the clip factor
            # and unscaling cost no pass over the gradients of their own.
            grad_scale = _grad_scale(factor, grads[0].device)
        else:
            _scale(grads, factor)
        had_state = {id(m) for m in self.masters if m in self.optimizer.state}
        if found_inf is not None:
            self.optimizer.found_inf = found_inf
        if grad_scale is not None:
            self.optimizer.grad_scale = grad_scale
        try:
            with _num_threads(self.threads):
                self.optimizer.step()
        finally:
            if found_inf is not None:
                del self.optimizer.found_inf
            if grad_scale is not None:
                del self.optimizer.grad_scale
        self.drop_grads()
        for unit, master in zip(self.units, self.masters):
            write_owned(unit, master.data)
        return had_state

    def _finish_early(self, factor, write_owned) -> set[int]:
        """The step of units stepped during backward: write the masters back to the parameters
        (only now: backward may have read them until its end)."""
        if torch.is_tensor(factor) or factor != 1.0:
            raise AssertionError(f"early CPU step with a gradient factor {factor} (clipping or "
                                 "loss scaling should have kept the step after backward)")
        self.early.active = False
        for unit, master in zip(self.units, self.masters):
            write_owned(unit, master.data)
        return {id(self.masters[i]) for i in range(len(self.masters))
                if self.units[i].index not in self.early.new_state}

    def _for_step(self, factor, found_inf):
        """Factor and flag where the step runs: an offloaded (CPU) step needs them in host memory,
        one small copy the host waits for."""
        if self.device is None or not (torch.is_tensor(factor) or found_inf is not None):
            return factor, found_inf
        both = [t.reshape(()).double() for t in (factor, found_inf) if torch.is_tensor(t)]
        packed = self.syncs.to_host(torch.stack(both), "offload: clip factor / overflow flag")
        factor = packed[0] if torch.is_tensor(factor) else factor
        return factor, (packed[-1].float() if found_inf is not None else None)

    def forget_new_state(self, had_state: set[int]) -> None:
        """After a step the kernels skipped: drop state the step created (a skipped first step
        leaves no state, as if it never ran; fused SGD's first momentum buffer is not zeroed).
        Units stepped during backward keep the state of an update that was applied."""
        if self.stepped_early:
            applied = set(self.early.updated())
            for unit, master in zip(self.units, self.masters):
                if id(master) not in had_state and unit.index not in applied:
                    self.optimizer.state.pop(master, None)
            return
        for master in self.masters:
            if id(master) not in had_state:
                self.optimizer.state.pop(master, None)

    def drop_grads(self) -> None:
        """Detach gradients from the masters (after a step, or when it is skipped)."""
        for master in self.masters:
            master.grad = None

    # -- checkpoints and in-place edits --------------------------------------------------------------
    def tensors(self, unit: Unit) -> tuple[torch.Tensor, dict]:
        """The unit's master and its optimizer state (tensors and scalars), readable and writable."""
        if self._early_now():
            raise RuntimeError(
                f"{unit.describe()}: its optimizer state is half-way through a step (units were "
                "stepped on the CPU during the backward that ended the accumulation window); "
                "call engine.step() before saving a checkpoint, or set zero_optimization."
                "offload_optimizer.zeroshard_step_in_backward to false")
        master = self.masters[unit.index]
        return master.data, dict(self.optimizer.state.get(master, {}))

    def install(self, unit: Unit, values: torch.Tensor, state: dict | None) -> None:
        """Set the unit's master to `values` and, unless None, its state to `state`."""
        if self.early is not None:  # loading replaces whatever a step in progress did
            self.early.wait()
            self.early.reset()
        master = self.masters[unit.index]
        if values.data_ptr() != master.data_ptr():
            master.data.copy_(values)
        if state:
            self.optimizer.state[master] = {k: self._placed(v) if torch.is_tensor(v) and v.dim()
                                            else v for k, v in state.items()}

    def _placed(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where this placement keeps state: host memory, or the compute device."""
        return to_host(tensor) if self.device is not None else tensor.to(self.masters[0].device)

    def update_master(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        """Overwrite elements `[lo, hi)` of the unit's master."""
        master = self.masters[unit.index]
        if master.data_ptr() != values.data_ptr():
            master.data[lo:hi].copy_(values)

    def flush(self) -> None:
        """Make writes through `tensors()` durable (NVMe only)."""

    # -- ledger --------------------------------------------------------------------------------------
    def ledger(self) -> dict[str, list]:
        """`{placement: [tensors]}` of optimizer bytes held in memory."""
        out = [t for state in self.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t)]
        return {self.name: out + [m.data for m in self.masters]}

    def nvme_bytes(self) -> int:
        """Bytes of swap files (NVMe only)."""
        return 0

    def buffer_ledger(self) -> dict[str, list]:
        """`{placement: [tensors]}` of staging buffers."""
        return {"cpu": list(self.grad_buffers or [])}

    def close(self) -> None:
        """Release files and threads."""
        if self.early is not None:
            self.early.close()


def reseat(optimizer: torch.optim.Optimizer, units: list[Unit], masters: list) -> None:
    """Point the user's param groups at the masters (same hyper-parameters, fresh state), with
    torch's fused kernel where it has one for the optimizer."""
    groups = optimizer.param_groups
    shards: list[list[nn.Parameter]] = [[] for _ in groups]
    for unit, master in zip(units, masters):
        shards[unit.group_index].append(master)
    optimizer.state.clear()
    use_fused = type(optimizer).__name__ in _FUSED_ON_CPU and \
        type(optimizer).__module__.startswith("torch.optim")
    for group, params in zip(groups, shards):
        group["params"] = params
        # torch 2.13's fused CPU SGD drops the update of bf16 tensors of 16+ elements
        # (bf16 masters): keep torch's default kernel there.
        broken = type(optimizer).__name__ == "SGD" and \
            any(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params)
        if use_fused and group.get("fused") is None and not group.get("foreach") \
                and not group.get("differentiable") and not broken:
            group["fused"] = True


def _grad_scale(factor, device: torch.device) -> torch.Tensor:
    """1 / `factor` (a float, or a 0-dim float64 tensor), as the 0-dim fp32 tensor torch's fused
    kernels divide gradients by (filled on the device: no host-to-device copy)."""
    one = torch.full((), 1.0, dtype=torch.float64, device=device)
    return one.div_(factor.to(device) if torch.is_tensor(factor) else factor).to(torch.float32)


def _scale(grads: list[torch.Tensor], factor) -> None:
    """Multiply `grads` in place by `factor` (a float, or a 0-dim float64 tensor). fp32 ones are
    divided by its fp32 reciprocal, bit for bit what a fused kernel given it as `grad_scale`
    does (so every placement steps alike); lower-precision ones are multiplied in fp32."""
    if not grads or (not torch.is_tensor(factor) and factor == 1.0):
        return
    fp32 = [g for g in grads if g.dtype == torch.float32]
    if fp32:
        torch._foreach_div_(fp32, _grad_scale(factor, fp32[0].device))
    for g in grads:
        if g.dtype != torch.float32:
            scaled = g.float().mul_(factor.to(g.device) if torch.is_tensor(factor) else factor)
            g.copy_(scaled)


def _offload_threads() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, (os.cpu_count() or 1) // max(1, local))


@contextlib.contextmanager
def _num_threads(threads: int | None):
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)

