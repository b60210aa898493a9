"""DeepSpeed's ZeRO-3 surface on zeroshard's objects: what Hugging Face, TRL, Accelerate and
DeepSpeed-Chat read from a stage-3 model, its parameters and its optimizer by DeepSpeed's names.
zeroshard's own loop reads none of it; core announces its moments through core/extensions.py
(zeroshard/__init__.py registers this module there) and this module answers:

* `unit_status`: each parameter of a stage-3 or construction-time unit gets `ds_id` (DeepSpeed's
  marker of a ZeRO-3 parameter: Hugging Face, TRL and DeepSpeed-Chat gather only the parameters
  that have one), `ds_shape`, `ds_numel`, `ds_active_sub_modules` and `ds_status`, kept current:
  core announces every gather issued, gather done and release, and the attributes are written
  then (one call per unit and change, as cheap as core writing them itself; a read costs
  nothing).
* `construction_slice`: a parameter partitioned by `zeroshard.Init` has `ds_tensor`, this rank's
  slice (1-D, padded), until an engine takes it over.
* `install(view)` (each stage-3 engine, with core/policy_view.py's read-only view): every unit's
  parameters get the attributes above from the view; sharded parameters refuse `torch.save`
  while released and `state_dict()` warns (guards.py); every module gets
  `ds_external_parameters()` (TRL iterates it with `named_parameters`), also a module attached
  later. Undone at the engine's close except what a parameter or module keeps.
* `optimizer_attribute`: `engine.optimizer.parameter_offload` (TRL's
  `unwrap_model_for_generation` removes and re-adds the stage-3 gather hooks around generation,
  inside a `GatheredParameters` of the whole model): `ParameterOffloadView`. Inside that context
  zeroshard's hooks gather nothing (every unit is pinned), so "removing" them is recorded and
  nothing else is needed.
"""

from __future__ import annotations

import types
import weakref
from typing import Callable

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from ...core.layout import Unit, ZeroParamStatus
from ...core.partition import external_parameters
from .guards import guard_pickling, guard_state_dict


def unit_status(unit: Unit, status: ZeroParamStatus) -> None:
    """Record `status` (and the real sizes) on every parameter of `unit`."""
    for slot in unit.slots:
        param = slot.param
        if not hasattr(param, "ds_id"):
            param.ds_id = id(param)  # unique while the parameter lives
            param.ds_active_sub_modules = set()  # TRL clears it around generation
        param.ds_status = status
        param.ds_shape = slot.shape
        param.ds_numel = slot.numel


def construction_slice(param: nn.Parameter, shard) -> None:
    """`param.ds_tensor`: this rank's slice while zeroshard.Init keeps it partitioned."""
    if shard is not None:
        param.ds_tensor = shard
    elif "ds_tensor" in param.__dict__:
        del param.ds_tensor


def install(view) -> Callable[[], None] | None:
    """DeepSpeed's attributes, the save guards and `ds_external_parameters()` on the view's model
    and its parameters; returns what removes the state_dict warnings and the watch for modules
    attached later."""
    for unit in view.units():
        gathered = view.is_gathered(unit)
        unit_status(unit, ZeroParamStatus.AVAILABLE if gathered else ZeroParamStatus.NOT_AVAILABLE)
    model = view.module
    if model is None:
        return None
    sharded = {id(p) for unit in view.sharded_units() for p in unit.params()}
    for param in model.parameters():
        if id(param) in sharded:
            guard_pickling(param)
    hooks = [guard_state_dict(module) for module in model.modules()]
    for module in model.modules():
        add_external_parameters_method(module)
    hooks.append(register_module_module_registration_hook(_on_attach))

    def uninstall() -> None:
        for hook in hooks:
            hook.remove()

    return uninstall


def add_external_parameters_method(module: nn.Module) -> None:
    """Give `module` `ds_external_parameters()`: (name, parameter) pairs of the other modules'
    parameters its forward uses (registered, or found by core/stage3_reads.py), as DeepSpeed's
    ZeRO-3 modules have."""
    if "ds_external_parameters" not in module.__dict__:
        module.ds_external_parameters = types.MethodType(_external, module)


def _external(module: nn.Module):
    return [(str(i), p) for i, p in enumerate(external_parameters(module))]


def _on_attach(parent: nn.Module, name: str, child):
    """A module attached to a module of a stage-3 model gets `ds_external_parameters()` too."""
    if child is not None and "ds_external_parameters" in parent.__dict__:
        for module in child.modules():
            add_external_parameters_method(module)


class ParameterOffloadView:
    """What TRL reads as `engine.optimizer.parameter_offload` at stage 3."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.forward_hooks: list = []
        self.backward_hooks: list = []

    def _register_deepspeed_module(self, module: nn.Module) -> None:
        """Re-adding the hooks: zeroshard's were never removed (see the module docstring)."""

    _register_hooks_recursively = _register_deepspeed_module


_OFFLOAD_VIEWS: "weakref.WeakKeyDictionary[object, ParameterOffloadView]" = \
    weakref.WeakKeyDictionary()


def optimizer_attribute(optimizer, name: str):
    """`parameter_offload` of a ZeroOptimizer (one view per optimizer); nothing else."""
    if name != "parameter_offload":
        raise AttributeError(name)
    view = _OFFLOAD_VIEWS.get(optimizer)
    if view is None:
        view = _OFFLOAD_VIEWS[optimizer] = ParameterOffloadView(optimizer.model)
    return view
