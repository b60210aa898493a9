"""Stage-3 units: which modules are gathered together, and how their parameters are laid out.

A stage-3 unit is a module subtree whose parameters are gathered just before it runs and freed
right after. The unit modules are, by default, the instances of every module class that repeats
in the model (a transformer's block class) and is not itself inside another repeating class;
`zero_optimization.zeroshard_unit_classes` names them explicitly instead. Containers
(ModuleList/ModuleDict) never count. Everything else forms the *root unit*, gathered by the
model's own forward hooks (embeddings, final norm, a head tied to the embedding).

Parameters smaller than `stage3_param_persistence_threshold` elements stay whole on every rank
(*persistent*) and are bucketed and reduce-scattered as at stage 2. A parameter shared by two
modules (tied weights) belongs to the first unit that reaches it in registration order; every
module that uses it gathers that unit too.

Each (unit module, param group, dtype) gives one `Unit` of the common layout.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from .init import take_full
from .layout import Slot, Unit, build_units, flatten, padded_size

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass
class Stage3Layout:
    """Units plus which modules need which of them."""

    units: list[Unit]
    #: id(module) -> indices of the sharded units that module's forward needs gathered.
    needs: dict[int, list[int]] = field(default_factory=dict)
    #: The hooked modules, outermost (the root) first.
    modules: list[nn.Module] = field(default_factory=list)
    #: Indices of units that stay whole on every rank (small parameters).
    persistent: set[int] = field(default_factory=set)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def unit_modules(model: nn.Module, class_names: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs that become stage-3 units, in registration order (root excluded)."""
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
    # Keep only outermost chosen modules (a chosen module inside another is part of it).
    out = []
    for name, module in named:
        if name in chosen and not any(name.startswith(o + ".") for o, _ in out):
            if _has_params(module):
                out.append((name, module))
    return out


def build_stage3_layout(model: nn.Module, group_of: dict[int, int], world_size: int,
                        bucket_numel: int, persistence_threshold: int,
                        class_names: list[str] | None = None) -> Stage3Layout:
    """Lay out `model`'s trainable parameters as stage-3 units (full flat buffers, not yet sharded)."""
    owners = unit_modules(model, class_names)
    owner_of_param: dict[int, int] = {}  # id(param) -> owner position (len(owners) = root)
    persistent_params: list[tuple[str, nn.Parameter]] = []
    by_owner: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(owners) + 1)]
    prefix_of = [name + "." for name, _ in owners]
    for name, param in model.named_parameters():
        if id(param) not in group_of:
            continue
        if param.numel() < persistence_threshold:
            persistent_params.append((name, param))
            owner_of_param[id(param)] = -1
            continue
        position = next((i for i, prefix in enumerate(prefix_of) if name.startswith(prefix)),
                        len(owners))
        owner_of_param[id(param)] = position
        by_owner[position].append((name, param))

    units: list[Unit] = []
    unit_ids_of_owner: list[list[int]] = []
    owner_names = [name for name, _ in owners] + [""]
    for position, params in enumerate(by_owner):
        take_full(p for _, p in params)  # a model built under Init: one module at a time
        ids = []
        groups: dict[tuple[int, torch.dtype], list[tuple[str, nn.Parameter]]] = {}
        for name, param in params:
            groups.setdefault((group_of[id(param)], param.dtype), []).append((name, param))
        for (group, dtype), members in groups.items():
            unit = _make_unit(len(units), group, dtype, members, world_size)
            unit.owner = owner_names[position] or "<root>"
            units.append(unit)
            ids.append(unit.index)
        unit_ids_of_owner.append(ids)

    layout = Stage3Layout(units)
    take_full(p for _, p in persistent_params)
    for unit in build_units(persistent_params, group_of, world_size, bucket_numel):
        unit.index = len(layout.units)
        unit.owner = "<persistent>"
        layout.units.append(unit)
        layout.persistent.add(unit.index)

    hooked = [("", model)] + owners
    for name, module in hooked:
        needed = set()
        for param in module.parameters():  # a tied weight is listed under every module using it
            position = owner_of_param.get(id(param))
            if position is None or position < 0:
                continue
            needed.update(unit_ids_of_owner[position])
        if module is model:
            # The root gathers its own unit, and units whose parameters modules outside every
            # unit module use (GPT-2's lm_head sharing the wte unit's weight).
            needed = set(unit_ids_of_owner[-1])
            for sub_name, sub in model.named_modules():
                if any(sub_name == p[:-1] or sub_name.startswith(p) for p in prefix_of):
                    continue
                for param in sub._parameters.values():
                    position = owner_of_param.get(id(param)) if param is not None else None
                    if position is not None and position >= 0:
                        needed.update(unit_ids_of_owner[position])
        layout.needs[id(module)] = sorted(needed)
        layout.modules.append(module)
    return layout


def _make_unit(index: int, group: int, dtype: torch.dtype, members, world_size: int) -> Unit:
    slots, offset = [], 0
    for name, param in members:
        slots.append(Slot(param, name, offset, param.numel(), param.shape))
        offset += param.numel()
    unit = Unit(index, group, dtype, slots, world_size, numel=offset,
                padded_numel=padded_size(offset, world_size))
    flatten(unit)
    return unit
