"""What every stage policy shares: which slice of each unit a rank owns and how gradients arrive.

A stage is a policy over the one layout of `layout.py`. It decides where gradients accumulate
(full per-unit buffers, or only this rank's shard), which collective averages them, and whether the
updated shards must be all-gathered after the optimizer step. A policy is built from a frozen
`StageSpec` (`spec.py`) and is complete when its constructor returns. The optimizer (`optim.py`) asks a
policy for three things: `reduce_gradients()` at the accumulation boundary, `grad_shard(unit)` (the
averaged gradient of the slice this rank steps), and `gather_params()` after the step.

The four stages (`stage0.py` .. `stage3.py`) each derive from `StagePolicy` only, never from one
another: what two of them share is a part they hold (`FullGradients` here, for stages 0-1; the
gradient reducer `grad_reducer.py`, for stages 2-3; stage 3's `param_gatherer.py`), and each holds
its own `StepState` (`training_state.py`) where its hooks check where the step is.
"""

from __future__ import annotations

import torch

from ..dist import Comm, wait_all
from .layout import Unit
from .spec import StageSpec
from ..dist.streams import Streams

# Reduce-scatters a stage keeps in flight while it goes on (computing backward, or launching the
# next unit). Each one pins a unit-sized gradient buffer and (N-1)/N of it in receive buffers.
# Measured on the 57 M-parameter bench model at 2 ranks: 1 instead of 2 costs ~2% of a stage-2
# step and lowers its peak RSS by ~108 MiB; 4 was no faster than 2.
MAX_IN_FLIGHT = 1


def eager_hook(fn):
    """`fn`, kept out of torch.compile's traced code (a graph break at each call instead)."""
    # The hooks gather, free and re-point parameters (`param.data = ...`, storage swaps) and
    # start collectives: traced, dynamo turns the `.data` assignments into in-graph `set_` calls
    # that bump the parameters' version counters (the "modified by an inplace operation" error of
    # backward) and fails on storage resizes; run eagerly, a compiled region only ever sees whole
    # parameters, between the hooks at unit boundaries.
    # torch.compiler.disable imports torch._dynamo (~1.3 s) when this module is imported; torch's
    # lazy form (the same disable; its wrapper is on dynamo's skip list, so a trace still breaks
    # once per call) imports it at the first call instead, so `import zeroshard` stays light.
    return torch._disable_dynamo(fn, recursive=True)


class StagePolicy:
    """What every stage shares: the slice of each unit a rank owns, and the interface the optimizer,
    the engine and checkpoints call (stages override what they do differently)."""

    stage = -1
    #: Each rank steps only its 1/N shard (stages >= 1) rather than the whole unit (stage 0).
    shards_optimizer = True

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *,
                 module: torch.nn.Module | None, streams: Streams):
        """Keep what every stage reads; a stage's own constructor then builds its parts and
        hooks (nothing is set up later).

        `streams`: the step's side streams (`dist/streams.py`, one owner, made by the builder)."""
        self.units = units
        self.module = module
        self.comm = comm
        self.overlap = spec.overlap_comm
        self.grad_place = spec.grad_place
        self.reduction = spec.reduction
        self.keeps_gradients = spec.keeps_gradients
        self.streams = streams
        self.hooks = []

    # -- ownership -----------------------------------------------------------------------------
    def owned_bounds(self, unit: Unit) -> tuple[int, int]:
        """`[start, end)` of the flat buffer this rank steps."""
        if self.shards_optimizer:
            return unit.shard_bounds(self.comm.rank)
        return 0, unit.padded_numel

    def owned_param(self, unit: Unit) -> torch.Tensor:
        """The compute-dtype parameter slice this rank steps (a view of the full flat buffer)."""
        lo, hi = self.owned_bounds(unit)
        return unit.flat[lo:hi]

    def read_owned(self, unit: Unit) -> torch.Tensor:
        """The owned compute-dtype slice's current values (a view where it lives in memory)."""
        return self.owned_param(unit)

    def write_owned(self, unit: Unit, values: torch.Tensor) -> None:
        """Set the owned compute-dtype slice from fp32 `values` (the updated master)."""
        owned = self.owned_param(unit)
        if owned.data_ptr() != values.data_ptr():
            owned.copy_(values, non_blocking=values.is_pinned())

    def commit(self, unit: Unit) -> None:
        """Make the owned slice reflect in-place changes to the full parameters (no-op: a view)."""

    # -- the step ----------------------------------------------------------------------------------
    def expect_boundary(self, boundary: bool) -> None:
        """Told before each engine backward whether it ends an accumulation window."""

    def defer_reduction(self) -> None:
        """Keep the gradients of the coming backwards local until `flush_reduction` (inside the
        engine's `coalesce_grad_reduction()`; below stage 2 nothing is reduced before the
        boundary anyway)."""

    def flush_reduction(self) -> None:
        """End `defer_reduction`: reduce, once, what the backwards since then accumulated."""

    def reduce_gradients(self) -> None:
        """Average gradients across ranks at the accumulation boundary."""
        raise NotImplementedError

    def grad_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's averaged gradient for the slice it steps (compute dtype)."""
        raise NotImplementedError

    def received_counts(self) -> torch.Tensor | None:
        """Every rank's step counts, if this step's gradient reduction carried them (stage 0;
        `step_check.py`); None: the norm's all-reduce carries them."""
        return None

    def note_loss(self, loss: torch.Tensor | None) -> None:
        """Told, before each engine backward, the loss it runs on (None: not seen)."""

    def loss_verdict(self) -> torch.Tensor | None:
        """A 0-dim inf/nan flag that stands in for the gradient norm's check (stage 0's
        `step_check.LossCheck`); None: the step checks the gradient norm."""
        return None

    def grad_token(self) -> int | None:
        """A value that changes whenever the gradients the step read are written again (None:
        not tracked)."""
        return None

    def replica_position(self) -> int:
        """Which replica of its shard group this rank is in (0 unless shards are replicated, as
        under MiCS): checkpoints write shards from replica 0 only."""
        return 0

    def gather_params(self) -> None:
        """Make full parameters current again after the optimizer updated this rank's shards."""
        handles = []
        for unit in self.units:
            lo, hi = unit.shard_bounds(self.comm.rank)
            handles.append(self.comm.all_gather(unit.flat, unit.flat[lo:hi], async_op=True,
                                                unit=unit))
        wait_all(handles)

    def zero_grad(self) -> None:
        """Clear accumulated gradients."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every gradient and any half-done backward (before loading a checkpoint)."""
        self.zero_grad()

    def unit_grad_is_finite(self, unit: Unit) -> bool:
        """Whether this rank's gradient slice of `unit` is free of inf/nan (error reporting only)."""
        return bool(torch.isfinite(self.grad_shard(unit)).all())

    # -- for the memory ledger ---------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        """Parameter storage this policy holds now (for the memory ledger)."""
        return [unit.flat for unit in self.units]

    def placed_param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """`{placement: tensors}` of parameter storage (offloaded stage-3 shards apart)."""
        return {"device": self.param_tensors()}

    def nvme_bytes(self) -> int:
        """Bytes of parameter swap files (stage 3 with offload_param nvme)."""
        return 0

    def grad_tensors(self) -> list[torch.Tensor]:
        """Gradient storage this policy keeps between steps (for the memory ledger)."""
        raise NotImplementedError

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Communication buffers held between collectives (for the memory ledger)."""
        return []

    def offload_buffer_tensors(self) -> list[torch.Tensor]:
        """Staging buffers of offloaded parameters (stage 3; for the memory ledger, on the CPU)."""
        return []

    # -- teardown ----------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Free memory kept for reuse (stage 3: gathered units and spare blocks); none below."""

    def drain(self) -> None:
        """Finish offload I/O in flight, ignoring failures (after one was reported)."""

    def close(self, keep_parameters: bool = True) -> None:
        """Remove hooks (used when an engine is torn down; parameters are whole below stage 3)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


class FullGradients:
    """Stages 0-1: one full gradient buffer per unit, each parameter's `.grad` a view into it, so
    autograd accumulates in place (zero-copy)."""

    def __init__(self, units: list[Unit], keeps_gradients: bool, extra: int = 0):
        """`extra`: elements of storage left after each buffer (stage 0's step counts)."""
        self.units = units
        self.flats: list[torch.Tensor] = []
        for unit in units if keeps_gradients else []:
            flat = torch.zeros(unit.padded_numel + extra, dtype=unit.dtype,
                               device=unit.compute_device)[:unit.padded_numel]
            for slot, view in unit.views(flat):
                slot.param.grad = view
            self.flats.append(flat)

    def hook(self, hooks: list, make_hook) -> None:
        """Register, on every parameter, the post-accumulate hook `make_hook(unit, slot, view)`
        (appended to `hooks`): one Python call per parameter and backward."""
        for unit, flat in zip(self.units, self.flats):
            for i, (slot, view) in enumerate(unit.views(flat)):
                hooks.append(slot.param.register_post_accumulate_grad_hook(
                    make_hook(unit, i, view)))

    def view(self, unit: Unit, slot: int) -> torch.Tensor:
        """Slot `slot` of `unit`'s gradient buffer, shaped as its parameter."""
        spec = unit.slots[slot]
        return self.flats[unit.index][spec.offset:spec.offset + spec.numel].view(spec.shape)

    def zero(self) -> None:
        """Zero every buffer (the views stay attached)."""
        for flat in self.flats:
            flat.zero_()


def reattach_hook(view: torch.Tensor):
    """After `model.zero_grad(set_to_none=True)` autograd hands a fresh tensor: fold it back in."""

    def hook(param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    return hook
