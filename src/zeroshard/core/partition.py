"""Stage-3 units: which modules are gathered together, and how their parameters are laid out.

A stage-3 unit is a set of parameters gathered just before the module that needs them runs and
freed right after. The *block* modules are, by default, the instances of every module class that
repeats in the model (a transformer's block class) and is not itself inside another repeating
class; `zero_optimization.zeroshard_unit_classes` names them explicitly instead. Containers
(ModuleList/ModuleDict) never count. A block's whole subtree is one unit. Parameters outside every
block form units per module holding them directly (the embedding, the final norm, the head; the
root model's own parameters, if any), each gathered around that module's own forward and
backward, so a large vocabulary's embedding is not held through the whole step.

Parameters smaller than `stage3_param_persistence_threshold` elements stay whole on every rank
(*persistent*) and are bucketed and reduce-scattered as at stage 2. A parameter shared by two
modules (tied weights: GPT-2's `lm_head` and `wte`) belongs to the unit of the first module that
holds it in registration order, and is laid out once; every module that uses it gathers that unit
too (it *borrows* it). A module whose forward uses another module's parameter directly (not by
calling that module) declares it with `zeroshard.zero.register_external_parameter(module, param)`,
or stage 3 finds it when it is read or returned (`stage3_reads.py`).

Each (owning module, param group, dtype) gives one `Unit` of the common layout. Building the
layout allocates nothing: `materialize.py` then shards the units one at a time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .layout import Slot, Unit, build_units, full_numel, full_shape, padded_size
from .leaf import is_leaf

#: Attribute on a module: {id(param): param} of other modules' parameters its forward uses
#: directly (DeepSpeed's name and shape, which callers read).
EXTERNAL_ATTR = "_external_params"

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
#: The group index of a unit of frozen parameters (no optimizer param group).
FROZEN = -1


@dataclass
class Stage3Layout:
    """Units plus which modules need which of them."""

    units: list[Unit]
    #: id(module) -> indices of the sharded units that module's forward needs gathered.
    needs: dict[int, list[int]] = field(default_factory=dict)
    #: id(module) -> the part of `needs` the module does not own (a tied or external weight):
    #: released again after the module's backward instead of waiting for their gradients.
    borrowed: dict[int, list[int]] = field(default_factory=dict)
    #: The hooked modules, outermost (the root) first.
    modules: list[nn.Module] = field(default_factory=list)
    #: Indices of units that stay whole on every rank (small parameters).
    persistent: set[int] = field(default_factory=set)
    #: Units of frozen parameters (no gradient, no optimizer state): sharded and gathered like
    #: the others, never reduced; their indices follow every unit of `units`.
    frozen: list[Unit] = field(default_factory=list)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that `module`'s forward uses `parameter` of another module directly (stage 3
    then gathers it around `module` too); DeepSpeed's name, a no-op below stage 3."""
    module.__dict__.setdefault(EXTERNAL_ATTR, {})[id(parameter)] = parameter


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The other modules' parameters `module`'s forward uses: registered, or found as they were
    used (stage3_reads.py)."""
    return list(module.__dict__.get(EXTERNAL_ATTR, {}).values())


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def unit_modules(model: nn.Module, class_names: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs that become stage-3 units, in registration order: ("", model)
    alone when the root is a leaf module (utils: set_z3_leaf_modules), else never the root."""
    if is_leaf(model):
        return [("", model)]
    named = [(n, m) for n, m in model.named_modules() if n and not isinstance(m, CONTAINERS)]
    if class_names is not None:
        wanted = set(class_names)
        found = {type(m).__name__ for _, m in named}
        unknown = sorted(wanted - found)
        if unknown:
            raise ValueError(
                f"zero_optimization.zeroshard_unit_classes: no module of class {unknown} in "
                f"{type(model).__name__}; classes present: {sorted(found)[:12]}")
        chosen = {n for n, m in named if type(m).__name__ in wanted}
    else:
        counts = Counter(type(m) for _, m in named if _has_params(m))
        repeated = {cls for cls, c in counts.items() if c > 1}
        # A repeating class inside another repeating class's instance is part of that unit.
        nested = set()
        for name, module in named:
            if type(module) in repeated:
                for child_name, child in module.named_modules():
                    if child_name and type(child) in repeated and type(child) is not type(module):
                        nested.add(type(child))
        chosen = {n for n, m in named if type(m) in repeated - nested}
    # DeepSpeed's leaf marks (leaf.py): a marked module is gathered whole. A marked container
    # (a ModuleList of experts) is never called itself: its children's reads gather it
    # (stage3_reads.py), all of it at once.
    every = [(n, m) for n, m in model.named_modules() if n]
    chosen |= {n for n, m in every if is_leaf(m)}
    # Keep only outermost chosen modules (a chosen module inside another is part of it).
    out = []
    for name, module in every:
        if name in chosen and not any(name.startswith(o + ".") for o, _ in out):
            if _has_params(module):
                out.append((name, module))
    return out


def build_stage3_layout(model: nn.Module, group_of: dict[int, int], world_size: int,
                        bucket_numel: int, persistence_threshold: int,
                        class_names: list[str] | None = None,
                        device: torch.device | None = None) -> Stage3Layout:
    """Lay out `model`'s parameters as stage-3 units (sizes and places only): trainable ones (in
    `group_of`) by optimizer group, and frozen ones (requires_grad False, not in the optimizer)
    in units of their own, so a frozen base is sharded too."""
    blocks = unit_modules(model, class_names)
    block_prefixes = [name + "." if name else "" for name, _ in blocks]  # "": the root is a leaf
    modules = dict(model.named_modules())
    owner_of: dict[int, str] = {}  # id(param) -> its owning module's name ("" = the root)
    by_owner: dict[str, list[tuple[str, nn.Parameter]]] = {}  # registration order of first param
    persistent_params: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():  # a tied weight once, under its first name
        trained = id(param) in group_of
        if not trained and param.requires_grad:
            continue  # gets gradients but no optimizer steps it: kept whole, as below stage 3
        if full_numel(param) < persistence_threshold:
            if trained:
                persistent_params.append((name, param))
            continue
        owner = next((p[:-1] for p in block_prefixes if name.startswith(p)), None)
        if owner is None:
            owner = name.rpartition(".")[0]
            while owner and isinstance(modules[owner], CONTAINERS):  # a ParameterList's user
                owner = owner.rpartition(".")[0]
        owner_of[id(param)] = owner
        by_owner.setdefault(owner, []).append((name, param))

    units: list[Unit] = []
    frozen: list[tuple[str, list]] = []  # (owner, members) of frozen units, numbered last
    units_of: dict[str, list[int]] = {}
    for owner, params in by_owner.items():
        groups: dict[tuple[int, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, param in params:
            groups.setdefault((group_of.get(id(param), FROZEN), param.dtype), []).append(
                (name, param))
        for (group, dtype), members in groups.items():
            if group == FROZEN:
                frozen.append((owner, members))
                continue
            unit = _make_unit(len(units), group, dtype, members, world_size, device)
            unit.owner = owner or "<root>"
            units.append(unit)
            units_of.setdefault(owner, []).append(unit.index)

    layout = Stage3Layout(units)
    for unit in build_units(persistent_params, group_of, world_size, bucket_numel, device,
                            materialize=False):
        unit.index = len(layout.units)
        unit.owner = "<persistent>"
        layout.units.append(unit)
        layout.persistent.add(unit.index)
    frozen_of: dict[str, list[int]] = {}
    for owner, members in frozen:
        unit = _make_unit(len(layout.units) + len(layout.frozen), FROZEN, members[0][1].dtype,
                          members, world_size, device)
        unit.owner = owner or "<root>"
        layout.frozen.append(unit)
        units_of.setdefault(owner, []).append(unit.index)
        frozen_of.setdefault(owner, []).append(unit.index)

    def units_for(params) -> set[int]:
        return {i for p in params if id(p) in owner_of for i in units_of[owner_of[id(p)]]}

    block_names = {name for name, _ in blocks}
    for name, module in modules.items():
        inside = any(name.startswith(p) for p in block_prefixes)
        if name in block_names:
            needed = units_for(module.parameters())
        elif not inside and not isinstance(module, CONTAINERS):
            # What it owns or holds itself (a tied weight); its children gather their own.
            needed = set(units_of.get(name, ())) | \
                units_for(p for p in module._parameters.values() if p is not None)
        else:
            needed = set()
        needed |= units_for(module.__dict__.get(EXTERNAL_ATTR, {}).values())
        # Hooked: what needs units, the root (its pre-hook also marks each new step), and every
        # other module outside the blocks with parameters below it, which marks the forward
        # stack that finds parameters used outside their module (stage3_reads.py).
        if not needed and module is not model and \
                (inside or isinstance(module, CONTAINERS) or not _has_params(module)):
            continue
        layout.needs[id(module)] = sorted(needed)
        # Borrowed and frozen units get no gradient to wait for: released once the module's
        # backward has reached its inputs.
        own_trained = set(units_of.get(name, ())) - set(frozen_of.get(name, ()))
        layout.borrowed[id(module)] = sorted(needed - own_trained)
        layout.modules.append(module)
    return layout


def _make_unit(index: int, group: int, dtype: torch.dtype, members, world_size: int,
               device: torch.device | None) -> Unit:
    slots, offset = [], 0
    for name, param in members:
        slots.append(Slot(param, name, offset, full_numel(param), full_shape(param)))
        offset += full_numel(param)
    return Unit(index, group, dtype, slots, world_size, numel=offset,
                padded_numel=padded_size(offset, world_size), device=device)
