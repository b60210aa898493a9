"""What every stage policy shares: which slice of each unit a rank owns and how gradients arrive.

A stage is a policy over the one layout of `layout.py`. It decides where gradients accumulate
(full per-unit buffers, or only this rank's shard), which collective averages them, and whether the
updated shards must be all-gathered after the optimizer step. A policy is built from a frozen
`StageSpec` (`spec.py`) and is complete when its constructor returns. The optimizer (`optim.py`) asks a
policy for three things: `reduce_gradients()` at the accumulation boundary, `grad_shard(unit)` (the
averaged gradient of the slice this rank steps), and `gather_params()` after the step.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

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
    """Base policy: full gradient buffers with parameter `.grad` views into them."""

    stage = -1
    #: Each rank steps only its 1/N shard (stages >= 1) rather than the whole unit (stage 0).
    shards_optimizer = True

    def __init__(self, units: list[Unit], comm: Comm, spec: StageSpec, *,
                 module: torch.nn.Module | None = None, syncs=None, early=None,
                 streams: Streams | None = None):
        """Lay out gradient storage and hook the model, from `spec` (no later set-up phase).

        `syncs`: the optimizer's counter of host synchronization points (`hostsync.py`);
        `early`: under optimizer offload, the per-unit CPU step (`offload/early.py`) handed each
        gradient shard as it becomes final in a boundary backward (stages 2-3), or None;
        `streams`: the step's side streams (`streams.py`; None: made here, for tests)."""
        self.units = units
        self.module = module
        self.comm = comm
        self.overlap = spec.overlap_comm
        self.grad_place = spec.grad_place
        self.reduction = spec.reduction
        self.accum_dtype = spec.accum_dtype
        self.keeps_gradients = spec.keeps_gradients
        self.syncs = syncs
        self.early = early
        self.streams = streams if streams is not None else Streams(
            units[0].compute_device if units else torch.device("cpu"))
        self.hooks = []
        self._attach()

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

    def param_tensors(self) -> list[torch.Tensor]:
        """Parameter storage this policy holds now (for the memory ledger)."""
        return [unit.flat for unit in self.units]

    def placed_param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """`{placement: tensors}` of parameter storage (offloaded stage-3 shards apart)."""
        return {"device": self.param_tensors()}

    def nvme_bytes(self) -> int:
        """Bytes of parameter swap files (stage 3 with offload_param nvme)."""
        return 0

    # -- construction ----------------------------------------------------------------------------
    def _attach(self) -> None:
        """Allocate gradient storage and register hooks (the last step of construction)."""
        self.flat_grads = []
        for unit in self.units if self.keeps_gradients else []:
            flat = self._new_grad_buffer(unit)
            for i, (slot, view) in enumerate(unit.views(flat)):
                # autograd accumulates in place into an existing .grad, so this is zero-copy.
                slot.param.grad = view
                self.hooks.append(slot.param.register_post_accumulate_grad_hook(
                    self._grad_hook(unit, i, view)))
            self.flat_grads.append(flat)

    def _grad_hook(self, unit: Unit, slot: int, view: torch.Tensor):
        """The post-accumulate-grad hook of `unit`'s parameter number `slot` (stage 0 adds its
        own work to it: one Python call per parameter and backward, not several)."""
        return _reattach_hook(view)

    def _new_grad_buffer(self, unit: Unit) -> torch.Tensor:
        """A zeroed full gradient buffer for `unit` (stage 0 leaves room after it)."""
        return torch.zeros(unit.padded_numel, dtype=unit.dtype, device=unit.compute_device)

    def expect_boundary(self, boundary: bool) -> None:
        """Told before each engine backward whether it ends an accumulation window (stage 0
        communicates in that backward only; the other stages need not know)."""

    #: Inside the engine's `coalesce_grad_reduction()`: gradients stay in full local buffers.
    deferring = False

    def defer_reduction(self) -> None:
        """Keep the gradients of the coming backwards local until `flush_reduction` (stages 2-3
        stop reducing in each backward; below, nothing is reduced before the boundary anyway)."""
        self.deferring = True

    def flush_reduction(self) -> None:
        """End `defer_reduction`: reduce, once, what the backwards since then accumulated."""
        self.deferring = False

    # -- the end-of-backward callback (stages that reduce during backward) -----------------------
    armed = True  # whether this backward queues `_end_of_backward` (stage 0: boundary only)
    callback_queued = False

    @eager_hook
    def _hook_outputs(self, _module, _inputs, output) -> None:
        """Forward hook on the model: a hook on its outputs queues the end-of-backward callback."""
        # The callback must join the *outer* backward: a hook on the model's outputs runs there
        # first, before any reentrant checkpoint starts a nested backward (whose end would
        # otherwise flush half-filled units).
        if torch.is_grad_enabled():
            for leaf in tree_leaves(output):
                if torch.is_tensor(leaf) and leaf.requires_grad:
                    leaf.register_hook(self._queue_end_of_backward)

    def _queue_end_of_backward(self, _grad=None) -> None:
        if self.armed and not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _launch(self, force: bool) -> None:
        """Start the collectives of the units whose gradients are complete, in layout order (all
        remaining ones when `force`); uses the stage's `missing`, `launched`, `next_launch`."""
        while self.next_launch < len(self.units):
            unit = self.units[self.next_launch]
            if self.missing[unit.index] > 0 and not force:
                return
            self.next_launch += 1
            if unit.index not in self.launched:
                self._launch_unit(unit)

    def _launch_unit(self, unit: Unit) -> None:
        raise NotImplementedError

    def _end_of_backward(self) -> None:
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        """Average gradients across ranks at the accumulation boundary."""
        raise NotImplementedError

    def received_counts(self) -> torch.Tensor | None:
        """Every rank's step counts, if this step's gradient reduction carried them (stage 0;
        `step_check.py`); None: the norm's all-reduce carries them."""
        return None

    def grad_shard(self, unit: Unit) -> torch.Tensor:
        """This rank's averaged gradient for the slice it steps (compute dtype)."""
        lo, hi = self.owned_bounds(unit)
        return self.flat_grads[unit.index][lo:hi]

    def gather_params(self) -> None:
        """Make full parameters current again after the optimizer updated this rank's shards."""
        handles = []
        for unit in self.units:
            lo, hi = unit.shard_bounds(self.comm.rank)
            handles.append(self.comm.all_gather(unit.flat, unit.flat[lo:hi], async_op=True,
                                                unit=unit))
        wait_all(handles)

    def zero_grad(self) -> None:
        """Clear accumulated gradients (keeping the views attached)."""
        for flat in self.flat_grads:
            flat.zero_()

    def reset(self) -> None:
        """Forget every gradient and any half-done backward (before loading a checkpoint)."""
        self.zero_grad()

    def grad_tensors(self) -> list[torch.Tensor]:
        """Gradient storage this policy keeps between steps (for the memory ledger)."""
        return list(self.flat_grads)

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Communication buffers held between collectives (for the memory ledger)."""
        return []

    def empty_cache(self) -> None:
        """Free memory kept for reuse (stage 3: gathered units and spare blocks); none below."""

    def drain(self) -> None:
        """Finish offload I/O in flight, ignoring failures (after one was reported)."""

    def offload_buffer_tensors(self) -> list[torch.Tensor]:
        """Staging buffers of offloaded parameters (stage 3; for the memory ledger, on the CPU)."""
        return []

    def unit_grad_is_finite(self, unit: Unit) -> bool:
        """Whether this rank's gradient slice of `unit` is free of inf/nan (error reporting only)."""
        return bool(torch.isfinite(self.grad_shard(unit)).all())

    def close(self, keep_parameters: bool = True) -> None:
        """Remove hooks (used when an engine is torn down; parameters are whole below stage 3)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


def _reattach_hook(view: torch.Tensor):
    """After `model.zero_grad(set_to_none=True)` autograd hands a fresh tensor: fold it back in."""

    def hook(param: torch.nn.Parameter) -> None:
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    return hook

