"""The sharded optimizer: the user's torch optimizer re-seated over this rank's shards.

`ZeroOptimizer` composes what `build.py` made: the units, the stage policy over them and the
placement of the fp32 master shards and optimizer state; it builds nothing itself. Its `step()`
is the same for every stage:
  1. the policy averages gradients across ranks (all-reduce / reduce-scatter / already done);
  2. the fp32 gradient of each owned shard is formed (a view in fp32, an upcast copy otherwise);
     with Muon, the Muon units' gradient shards are first replaced by their orthogonalised
     updates (`muon_exchange.py`: two all-to-alls between the ranks holding and owning matrices);
  3. one scalar all-reduce gives the global gradient norm over all shards, which detects fp16
     overflow and drives clipping; unscaling and clipping are applied as one multiply, by a
     factor computed on the device (min(1, clip / (norm + 1e-6)) / loss scale). Stage 0 without
     clipping or loss scaling forms no norm (DDP forms none): its inf/nan check is then the
     losses' (`step_check.LossCheck`), and the norm is formed only if asked for
     (`last_grad_norm`);
  4. the user's optimizer steps over the shard parameters (fused kernel where torch has one).
     An inf/nan norm is not read on the host before the step: torch's fused kernels take it as
     `found_inf` and leave parameters and state untouched; the host reads that one flag after
     the whole step is queued (`dist/hostsync.py`) to skip the LR scheduler, update the fp16 loss scale
     or raise NonFiniteGradientError. Non-fused optimizers read it before stepping instead;
  5. the fp32 master shard is copied back into the compute-dtype shard (unless it is that shard);
  6. the policy all-gathers the updated shards (stages 1-2).
Where the masters and optimizer state live, and so how steps 2-5 run, is the placement's business
(`offload/optimizer.py`: the device, CPU memory, or NVMe swap files stepped unit by unit); the
placement writes each updated master back through the policy's `write_owned`, which the step hands
it (the placement holds no reference to the policy).
"""

from __future__ import annotations

import errno
import warnings

import torch
from torch import nn

from ..dist import Comm, default_device
from ..dist.hostmem import host_region
from . import extensions
from ..dist.hostsync import HostSyncs
from .grad_norm import StepNorm, norm_and_flag
from .layout import Unit
from .owners import forget, register
from .policy import StagePolicy
from .scaler import LossScaler
from . import step_check
from ..dist.steps import DesyncError


class NonFiniteGradientError(FloatingPointError):
    """A gradient was inf/nan outside fp16 loss scaling; the step was not applied."""


class NonFiniteGradientWarning(UserWarning):
    """A bf16 step skipped for an inf/nan gradient (bf16.check_grad_overflow)."""


class ZeroOptimizer(torch.optim.Optimizer):
    """Steps the user's optimizer over this rank's shards and keeps full parameters in sync.

    It subclasses `torch.optim.Optimizer` only so that torch LR schedulers accept it; the
    param groups and state it exposes are those of the re-seated user optimizer.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 units: list[Unit], policy: StagePolicy, placement, *, clip_norm: float,
                 scaler: LossScaler, syncs: HostSyncs, world_comm: Comm | None = None,
                 frozen_units: list[Unit] = (), skip_nonfinite: bool = False, muon=None):
        """Compose the parts `build.py` made: `units` (cast to the compute dtype), the stage
        `policy` over them, and the `placement` of masters and optimizer state (which re-seated
        `optimizer` on its masters). `world_comm` numbers ranks for GatheredParameters when
        `comm` is a MiCS shard group; `frozen_units`: stage 3's units of frozen parameters
        (sharded, gathered by the policy, no masters); `skip_nonfinite`: an inf/nan gradient
        skips the step instead of raising (bf16's check_grad_overflow; fp16 always skips);
        `muon`: the `MuonExchange` that orthogonalises the Muon units' gradients before each
        step (None without Muon)."""
        # torch.optim.Optimizer.__init__ is deliberately not called: there is no second state.
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self.comm = comm
        self.clip_norm = clip_norm
        self.scaler = scaler
        self.skip_nonfinite = skip_nonfinite
        self.optimizer = optimizer
        self.model = model
        self.units = units
        #: Stage 3's units of frozen parameters: the policy gathers them, nothing steps them.
        self.frozen_units = list(frozen_units)
        self.policy = policy
        self.placement = placement
        self.masters = placement.masters
        #: Muon's per-matrix owners and momentum (core/muon_exchange.py), or None.
        self.muon = muon
        #: The compute device: units are gathered and computed with here.
        self.device = units[0].compute_device if units else default_device()
        #: The unclipped global gradient norm of the last applied step (grad_norm.py).
        self.norm = StepNorm(self.device)
        self.step_applied = False
        #: Host synchronization points of the step, counted by reason (shared with the parts).
        self.syncs = syncs
        self.steps = 0
        #: The I/O error (NvmeError) of a step that failed half-way; cleared by loading a checkpoint.
        self.broken: OSError | None = None
        for unit in self.all_units:  # GatheredParameters & co. find a parameter's owner here
            register(self, unit, world_comm or comm)

    # -- construction --------------------------------------------------------------------------
    def refresh_master(self, unit: Unit, param: nn.Parameter) -> None:
        """Re-take the fp32 master of `param`'s owned part after the parameter changed in place."""
        slot = next(s for s in unit.slots if s.param is param)
        lo, hi = self.policy.owned_bounds(unit)
        self.policy.commit(unit)
        if unit.group_index < 0:
            return  # a frozen unit has no master
        start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if start < end:
            owned = self.policy.read_owned(unit)
            self.placement.update_master(unit, start - lo, end - lo, owned[start - lo:end - lo])

    # -- the optimizer interface users see -------------------------------------------------------
    @property
    def param_groups(self):
        """The re-seated torch optimizer's param groups (LR schedulers act on these)."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The re-seated torch optimizer's per-shard state."""
        return self.optimizer.state

    @property
    def defaults(self):
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    @property
    def overflow(self) -> bool:
        """DeepSpeed's flag (accelerate reads it): the last optimizer step was skipped (fp16)."""
        return self.steps > 0 and not self.step_applied

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's name for the current fp16 loss scale (1.0 without loss scaling)."""
        return self.scaler.scale

    cur_scale = loss_scale  # DeepSpeed's other spelling (its fp16 optimizers)

    @property
    def all_units(self) -> list[Unit]:
        """The trained units, then stage 3's frozen ones."""
        return [*self.units, *self.frozen_units]

    def __getattr__(self, name: str):
        """Names the optimizer lacks, answered by what is installed on top of core
        (extensions.py: compat/deepspeed's `parameter_offload`, which TRL reads)."""
        if name.startswith("_"):  # torch's and Python's own probes: never an extension's
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return extensions.optimizer_attribute(self, name)

    def state_dict(self):
        """Refused: the optimizer state is sharded over ranks; it is saved and loaded whole by
        `engine.save_checkpoint` / `engine.load_checkpoint`."""
        raise RuntimeError("ZeroOptimizer.state_dict(): this rank holds only its shard of the "
                           "optimizer state; save and load it with engine.save_checkpoint(dir) / "
                           "engine.load_checkpoint(dir) (every rank calls them)")

    def load_state_dict(self, state_dict) -> None:
        """Refused, as state_dict() (use engine.load_checkpoint)."""
        self.state_dict()

    def install_loaded(self, trained, frozen=(), **loaded) -> None:
        """Replace this rank's shards by a loaded checkpoint's (`install_loaded` below)."""
        install_loaded(self, trained, frozen, **loaded)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (buffers are zeroed and stay attached)."""
        self.policy.zero_grad()

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Average, unscale, clip and apply one optimizer step; False if fp16 overflow skipped it."""
        with host_region():  # strict host mode: offloaded state stays apart from device memory
            return self._step(closure)

    def _step(self, closure) -> bool:
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure (LBFGS-style optimizers "
                             "need whole tensors and are not supported)")
        if self.broken is not None:
            raise type(self.broken)(
                errno.EIO, f"rank {self.comm.rank}: no optimizer step is taken after an NVMe "
                f"failure left the state partly updated ({self.broken}); load the last checkpoint "
                "(engine.load_checkpoint) to continue")
        self.policy.reduce_gradients()
        grads = [self.policy.grad_shard(unit) for unit in self.units]
        scale = self.scaler.scale
        if self.muon is not None:
            # Newton-Schulz drops the loss scale; the update gets it back, so the norm, the
            # overflow check and the unscaling treat it as they treat a gradient.
            grads = self.muon.orthogonalize(grads, scale)
        norm, found_inf, counts = norm_and_flag(self, grads, scale)
        self.steps += 1
        factor = clip_factor(norm, scale, self.clip_norm)
        masked = self.placement.can_mask()
        if counts is not None:
            # Ranks at different steps (step_check.py): the fused kernels skip this step as they
            # would an overflow, and the host, reading flag and counts at once, raises.
            found_inf = torch.maximum(found_inf, step_check.disagree(counts, self.comm.rank))
            flag = torch.cat([found_inf.double().reshape(1), counts.double()])
        else:
            flag = found_inf
        # Queued now, read once the step is queued too: the host then waits only for the norm.
        flag = self.syncs.start_read(flag)
        if not masked and self._read_flag(flag, "non-finite check (non-fused optimizer)"):
            return self._skip()
        try:
            had_state = self.placement.step(factor, found_inf if masked else None,
                                            self.policy.write_owned)
            self.policy.gather_params()
        except OSError as err:  # the placement's I/O (offload/nvme.py's NvmeError)
            self.broken = err
            self.policy.drain()
            raise type(err)(err.errno, f"rank {self.comm.rank}, optimizer step {self.steps}: {err}. "
                            "The step was only partly applied; load the last checkpoint "
                            "(engine.load_checkpoint) to continue") from err
        if masked and self._read_flag(flag, "non-finite check (after the step is queued)",
                                      lambda: self.placement.forget_new_state(had_state)):
            self.placement.forget_new_state(had_state)  # a skipped first step leaves no state
            return self._skip()
        if self.muon is not None:
            self.muon.commit()
        self.norm.formed(norm, grads, self.policy.grad_token())
        self.scaler.update(overflow=False, step=self.steps)
        self.step_applied = True
        return True

    def _read_flag(self, pending, why: str, undo=None) -> bool:
        """Whether the step's gradient norm is inf/nan (the one host read of the step); when the
        ranks' step counts came with it and disagree, `undo()` and raise DesyncError."""
        values = self.syncs.finish_read(pending, why)
        if not isinstance(values, list):
            return bool(values)
        try:
            step_check.check(values[1:])
        except DesyncError:
            self.placement.drop_grads()
            if undo is not None:
                undo()
            raise
        return bool(values[0])

    def _skip(self) -> bool:
        """An inf/nan gradient: nothing was applied. fp16 skips the step; otherwise raise."""
        self.placement.drop_grads()
        if self.muon is not None:
            self.muon.discard()
        self.norm.drop()
        if self.scaler.enabled:
            self.scaler.update(overflow=True, step=self.steps)
            self.step_applied = False
            return False
        if self.skip_nonfinite:
            if self.comm.rank == 0:
                warnings.warn(f"{nonfinite_message(self, skipped=True)}", NonFiniteGradientWarning,
                              stacklevel=4)
            self.step_applied = False
            return False
        message = nonfinite_message(self)
        # Nothing was applied; clearing the gradients lets a caller skip the bad batch.
        self.policy.zero_grad()
        raise NonFiniteGradientError(message)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last applied step's unclipped global gradient norm, a device tensor (grad_norm.py:
        formed now if that step deferred it), or None."""
        return self.norm.tensor(self.policy.grad_token())

    @property
    def last_grad_norm(self) -> float | None:
        """The same, read on the host now."""
        norm = self.grad_norm
        return None if norm is None else float(self.syncs.read(norm, "grad norm asked for"))

    # -- ledger ----------------------------------------------------------------------------------
    def ledger(self) -> list[tuple[str, str, list[torch.Tensor]]]:
        """`(kind, placement, tensors)` for what this rank holds in memory (`ledger_entries`)."""
        return ledger_entries(self.placement, self.policy, self.muon)

    def nvme_bytes(self) -> dict[str, int]:
        """Bytes of swap files by kind ("params", "optimizer")."""
        return {"optimizer": self.placement.nvme_bytes(), "params": self.policy.nvme_bytes()}

    def close(self, keep_parameters: bool = True) -> None:
        """Remove the policy's hooks, release offload files and threads (see Engine.destroy)."""
        self.policy.close(keep_parameters)
        self.placement.close()
        for unit in self.all_units:
            forget(unit)


def nonfinite_message(opt: ZeroOptimizer, skipped: bool = False) -> str:
    """What an inf/nan gradient norm at `opt`'s step is reported as (`skipped`: bf16's
    check_grad_overflow skipped it), naming the units whose gradients are bad on this rank."""
    bad = [u.describe() for u in opt.units if not opt.policy.unit_grad_is_finite(u)]
    where = f" on rank {opt.comm.rank} in {', '.join(bad[:3])}" if bad else \
        f" on another rank than {opt.comm.rank}"
    if skipped:
        return (f"gradient norm is inf/nan at optimizer step {opt.steps}{where}; the step was "
                "skipped (bf16.check_grad_overflow, counted in skipped_steps)")
    return (f"gradient norm is inf/nan at optimizer step {opt.steps}{where}; the step was not "
            "applied and parameters are unchanged. Check the loss for nan/inf (bad batch, "
            "log of 0, too high learning rate) or use fp16 loss scaling / bf16.")


def clip_factor(norm: torch.Tensor | None, scale: float, clip_norm: float):
    """What the gradients are multiplied by: 1/scale as a float without clipping, else a device
    tensor (1/scale) x min(1, clip / (norm + 1e-6)), never read on the host."""
    if clip_norm <= 0:
        return 1.0 / scale
    return torch.where(norm > clip_norm, clip_norm / (norm + 1e-6), 1.0) * (1.0 / scale)


def ledger_entries(placement, policy: StagePolicy, muon) -> list[tuple[str, str, list]]:
    """`(kind, placement, tensors)` for what this rank holds in memory. The memory ledger counts
    each storage once, under the first entry naming it: offloaded parts come first, then
    parameters (an fp32 master that is the owned parameter slice counts as a parameter)."""
    entries = [("optimizer", where, tensors) for where, tensors in placement.ledger().items()]
    if muon is not None:
        entries.append(("optimizer", muon.place, muon.tensors()))
    entries += [("buffers", where, tensors)
                for where, tensors in placement.buffer_ledger().items()]
    entries.append(("buffers", "cpu", policy.offload_buffer_tensors()))
    entries += [("params", where, tensors)
                for where, tensors in policy.placed_param_tensors().items()]
    entries += [("grads", policy.grad_place, policy.grad_tensors()),
                ("buffers", "device", policy.buffer_tensors())]
    # Device-resident entries after the parameters they may alias.
    return sorted(entries, key=lambda e: e[1] == "device" and e[0] != "params")


def build_optimizer(spec, params, module: nn.Module | None = None) -> torch.optim.Optimizer:
    """Build a torch optimizer from the config's `optimizer` block, with DeepSpeed's meanings
    (`module`: the model, whose parameter names Muon's split into matrices and the rest reads)."""
    kind = spec.type.lower()
    hp = dict(spec.params)
    if kind == "muon":
        from .muon import build_muon  # noqa: PLC0415 - only Muon runs need it

        if module is None:
            raise ValueError("optimizer Muon is built from the model (its parameter names "
                             "decide which get Muon); pass module=")
        return build_muon(module, params, hp)
    hp.pop("bias_correction", None)  # only true passes the config check: torch always corrects
    if kind == "adam":
        # DeepSpeed's "Adam" decouples weight decay (AdamW) unless adam_w_mode is false.
        adam_w_mode = hp.pop("adam_w_mode", True)
        hp.pop("torch_adam", None)
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        hp.setdefault("weight_decay", 0.0)  # DeepSpeed's default, not torch AdamW's 0.01
    elif kind == "adamw":
        hp.pop("adam_w_mode", None)
        hp.pop("torch_adam", None)
        cls = torch.optim.AdamW
        hp.setdefault("weight_decay", 0.0)
    elif kind == "sgd":
        cls = torch.optim.SGD
    elif kind == "adagrad":
        cls = torch.optim.Adagrad
    elif kind == "lion":
        from .lion import Lion  # noqa: PLC0415 - only Lion runs need it
        cls = Lion
        hp.setdefault("lr", 1e-3)  # DeepSpeed's FusedLion defaults, not the paper's
        hp.setdefault("betas", (0.9, 0.999))
    else:
        raise ValueError(
            f"optimizer.type {spec.type!r} is not available in zeroshard: it needs whole tensors "
            "or DeepSpeed's custom kernels. Use Adam, AdamW, SGD, Adagrad, Lion or Muon, or pass "
            "a torch optimizer instance to initialize(optimizer=...).")
    try:
        return cls(params, **hp)
    except TypeError as err:
        raise ValueError(f"optimizer.params for {spec.type}: {err}") from None


def install_loaded(opt: ZeroOptimizer, trained, frozen=(), *, optimizer_state: bool = True,
                   muon=None, hyper: list[dict] | None = None) -> None:
    """Replace `opt`'s shards on this rank by a loaded checkpoint's (`state.ShardedState` reads it).

    `trained` yields `(unit, owned values, optimizer state or None: the state as it is)`,
    `frozen` `(unit, owned shard)` of stage 3's frozen units; with `optimizer_state`, `muon` is
    Muon's loaded momentum (its `install`) and `hyper` per param group the hyper-parameters to
    set. Gradients accumulated before (or left by a step that failed half-way) and gathered
    stage-3 units are dropped first; the stage's parameters are whole again after, and the
    refusal to step after an NVMe failure is lifted (every master, state and parameter shard was
    rewritten)."""
    with torch.no_grad():
        opt.policy.reset()
        for unit, values, state in trained:
            opt.policy.write_owned(unit, values)
            opt.placement.install(unit, values, state)
        for unit, shard in frozen:
            opt.policy.write_owned(unit, shard)
        opt.placement.flush()
        if optimizer_state and opt.muon is not None:
            opt.muon.install(muon)
        opt.policy.gather_params()
        opt.broken = None
        for group, values in zip(opt.param_groups, hyper or ()):
            group.update(values)
