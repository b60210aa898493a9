"""DeepSpeed's internal names that code outside DeepSpeed reads from an engine, answered here.

Nothing in zeroshard's own loop uses these; they exist because real callers do:

* `engine.tput_timer` (DeepSpeed-Chat calls `update_epoch_count()` after each epoch and reads
  samples per second): `ThroughputTimer`, counting from the engine's own counters.
* `engine.optimizer.parameter_offload` (TRL's `unwrap_model_for_generation` removes and re-adds
  the stage-3 gather hooks around generation, inside a `GatheredParameters` of the whole model):
  `ParameterOffloadView`. Inside that context zeroshard's hooks gather nothing (every unit is
  pinned), so "removing" them is recorded and nothing else is needed.
* `module.ds_external_parameters()` on every module of a stage-3 model (TRL iterates it with
  `named_parameters`): `add_external_parameters_method`.
"""

from __future__ import annotations

import time
import types

from torch import nn

from .partition import EXTERNAL_ATTR


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`, over the engine's counters."""

    def __init__(self, engine):
        self._engine = engine
        self.epoch_count = 0
        self._started = time.perf_counter()
        self._first_samples = engine.global_samples

    @property
    def global_step_count(self) -> int:
        """Optimizer steps taken."""
        return self._engine.global_steps

    @property
    def micro_step_count(self) -> int:
        """Micro-steps (forward/backward passes) taken."""
        return self._engine.micro_steps

    def update_epoch_count(self) -> None:
        """Count one finished epoch."""
        self.epoch_count += 1

    def start(self) -> None:
        """Restart the clock the rate is measured from."""
        self._started = time.perf_counter()
        self._first_samples = self._engine.global_samples

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Accepted for DeepSpeed's callers; the counters live in the engine."""

    def avg_samples_per_sec(self) -> float:
        """Samples (over all ranks) per second since the clock started."""
        elapsed = time.perf_counter() - self._started
        done = self._engine.global_samples - self._first_samples
        return done / elapsed if elapsed > 0 else 0.0


class ParameterOffloadView:
    """What TRL reads as `engine.optimizer.parameter_offload` at stage 3."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward_hooks: list = []
        self.backward_hooks: list = []

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Re-adding the hooks: zeroshard's were never removed (see the module docstring)."""

    _register_hooks_recursively = _register_deepspeed_module


def add_external_parameters_method(model: nn.Module) -> None:
    """Give every module `ds_external_parameters()`: (name, parameter) pairs registered with
    `register_external_parameter`, as DeepSpeed's ZeRO-3 modules have."""
    for module in model.modules():
        if "ds_external_parameters" not in module.__dict__:
            module.ds_external_parameters = types.MethodType(_external, module)


def _external(module: nn.Module):
    return [(str(i), p) for i, p in enumerate(module.__dict__.get(EXTERNAL_ATTR, []))]
