"""Engines without an optimizer: `initialize(model=..., config=...)` with neither an optimizer nor
an `optimizer` block (reference and reward models in RLHF, evaluation-only engines).

The model is laid out and partitioned exactly as for training (same units, same stage-3 gathers
around each forward), but nothing is kept for training: no fp32 master or optimizer state
(`NoPlacement` holds nothing), and the stage policy is told to allocate no gradient storage and
hook nothing for backward (`StageSpec.keeps_gradients`), so `memory_report()` shows 0 for grads and
optimizer and no gradient-sized buffer is ever allocated. `backward`
and `step` are refused by the engine with an error saying why.
"""

from __future__ import annotations

import torch

REFUSAL = ("this engine was built without an optimizer (initialize() got neither optimizer= nor "
           "an \"optimizer\" config block), for inference only: it keeps no gradients or "
           "optimizer state, so {what} is not possible. Pass an optimizer to initialize() to "
           "train the model.")


def placeholder_optimizer(params) -> torch.optim.Optimizer:
    """An optimizer that only names the parameters to lay out (never stepped)."""
    # One group, possibly empty: a model whose parameters are all frozen (a reference model)
    # is laid out as frozen units only.
    opt = torch.optim.SGD([{"params": list(params)}], lr=0.0)
    opt._zeroshard_no_optimizer = True
    return opt


def is_placeholder(optimizer) -> bool:
    """Whether `optimizer` is the stand-in of an engine without an optimizer."""
    return getattr(optimizer, "_zeroshard_no_optimizer", False)


class NoPlacement:
    """The optimizer placement of an engine without an optimizer: no masters, no state."""

    name = "device"
    early = None

    def __init__(self, units):
        # One empty stand-in per unit: the placeholder's param groups point at these.
        self.masters = [torch.nn.Parameter(torch.empty(0, device=unit.compute_device),
                                           requires_grad=False) for unit in units]

    def ledger(self) -> dict:
        """Nothing held."""
        return {}

    def buffer_ledger(self) -> dict:
        """Nothing held."""
        return {}

    def nvme_bytes(self) -> int:
        """No swap files."""
        return 0

    def update_master(self, unit, start: int, end: int, values) -> None:
        """No master to keep in step with a changed parameter."""

    def close(self) -> None:
        """Nothing to release."""

    def flush(self) -> None:
        """Nothing to write."""

    def _refuse(self, *_args, **_kwargs):
        raise RuntimeError(REFUSAL.format(what="an optimizer step or optimizer state"))

    sq_norm = step = drop_grads = tensors = install = _refuse


def make_no_placement(optimizer, units) -> NoPlacement:
    """The placement of an engine without an optimizer (its param groups point at stand-ins)."""
    placement = NoPlacement(units)
    groups = optimizer.param_groups
    for g, group in enumerate(groups):
        group["params"] = [m for unit, m in zip(units, placement.masters) if unit.group_index == g]
    optimizer.state.clear()
    return placement
