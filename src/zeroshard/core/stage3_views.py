"""What callers outside zeroshard read from a stage-3 model and its optimizer, by DeepSpeed's names.

Nothing in zeroshard's own loop uses these; they exist because real callers do, on zeroshard's own
objects (so they stay with them here rather than in compat/, which core never imports; the
engine's `tput_timer` is monitor/timers.py's ThroughputTimer):

* `engine.optimizer.parameter_offload` (TRL's `unwrap_model_for_generation` removes and re-adds
  the stage-3 gather hooks around generation, inside a `GatheredParameters` of the whole model):
  `ParameterOffloadView`. Inside that context zeroshard's hooks gather nothing (every unit is
  pinned), so "removing" them is recorded and nothing else is needed.
* `module.ds_external_parameters()` on every module of a stage-3 model (TRL iterates it with
  `named_parameters`): `add_external_parameters_method`, which stage3_reads.py applies to each
  module, also to those attached after `initialize()`.
"""

from __future__ import annotations

import types

from torch import nn

from .partition import EXTERNAL_ATTR


class ParameterOffloadView:
    """What TRL reads as `engine.optimizer.parameter_offload` at stage 3."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward_hooks: list = []
        self.backward_hooks: list = []

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Re-adding the hooks: zeroshard's were never removed (see the module docstring)."""

    _register_hooks_recursively = _register_deepspeed_module


def add_external_parameters_method(module: nn.Module) -> None:
    """Give `module` `ds_external_parameters()`: (name, parameter) pairs of its external
    parameters (registered, or found by stage3_reads.py), as DeepSpeed's ZeRO-3 modules have."""
    if "ds_external_parameters" not in module.__dict__:
        module.ds_external_parameters = types.MethodType(_external, module)


def _external(module: nn.Module):
    return [(str(i), p) for i, p in enumerate(module.__dict__.get(EXTERNAL_ATTR, {}).values())]
