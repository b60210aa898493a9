"""Stage-3 leaf modules: a module marked as a leaf is gathered whole at its forward and its
submodules get no gather hooks of their own. Here a marked module becomes one stage-3 unit
(core/partition.py reads the mark with `is_leaf`). Mixture-of-experts blocks want it: their
experts run in data-dependent order, and a different expert on each rank would otherwise gather
different units, in different orders, and hang.

Modules are chosen by class (a type matches its subclasses too; a string matches the class's
`__name__` or its fully-qualified `module.qualname`), by name (as `named_modules()` spells it) or
by name suffix. The config's `zero_optimization.leaf_module` section (`classes`, `names`,
`name_suffixes`) applies the marks at `initialize()` (`apply_leaf_module_config`); DeepSpeed's
functions over the same marks (`set_z3_leaf_modules` and friends, with their errors) are
compat/deepspeed/utils/z3_leaf.py.
"""

from __future__ import annotations

import logging

from torch import nn

LEAF_ATTR = "_z3_leaf"

_log = logging.getLogger("zeroshard")


def _qualified(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def is_of_classes(module: nn.Module, classes) -> bool:
    """Whether `module` is of one of `classes` (types, class names or `module.qualname`s)."""
    for wanted in classes:
        if isinstance(wanted, type):
            if isinstance(module, wanted):
                return True
        elif wanted in (type(module).__name__, _qualified(module)):
            return True
    return False


def modules_of_classes(model: nn.Module, classes) -> list[nn.Module]:
    """The modules of `model` of one of `classes` (subclasses too), in `modules()` order."""
    return [m for m in model.modules() if is_of_classes(m, classes)]


def modules_named(model: nn.Module, names) -> tuple[list[nn.Module], list[str]]:
    """(the modules of `model` with these `named_modules()` names, the names not found)."""
    by_name = dict(model.named_modules())
    return [by_name[n] for n in names if n in by_name], [n for n in names if n not in by_name]


def modules_with_suffixes(model: nn.Module, suffixes) -> tuple[list[nn.Module], list[str]]:
    """(the modules whose `named_modules()` name ends with one of `suffixes`, each once; the
    suffixes that matched nothing)."""
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            found.setdefault(id(module), module)
    return list(found.values()), missing


def mark(modules, flag: bool = True) -> None:
    """Set (or with `flag` false, clear) the leaf mark of each of `modules`."""
    for module in modules:
        setattr(module, LEAF_ATTR, flag)


def is_leaf(module: nn.Module) -> bool:
    """Whether the module is marked as a leaf."""
    return bool(getattr(module, LEAF_ATTR, False))


def apply_leaf_module_config(model: nn.Module, section) -> list[nn.Module]:
    """Mark the modules the config's `zero_optimization.leaf_module` section names (`section`: its
    validated block, config/leaf_module.py); returns them, each once. Names and suffixes that
    match nothing, and a section written by the user that matches nothing at all, are logged as
    warnings (the defaults name Hugging Face MoE classes most models do not have: silent)."""
    if section is None:
        return []
    default = type(section)()
    marked: dict[int, nn.Module] = {}
    for module in modules_of_classes(model, section.classes):
        marked.setdefault(id(module), module)
    for key, find in (("names", modules_named), ("name_suffixes", modules_with_suffixes)):
        wanted = getattr(section, key)
        if not wanted:
            continue
        found, missing = find(model, wanted)
        for module in found:
            marked.setdefault(id(module), module)
        if missing and wanted != getattr(default, key):
            _log.warning("zero_optimization.leaf_module.%s: nothing in %s matches %s", key,
                         type(model).__name__, missing)
    mark(marked.values())
    if not marked and section != default:
        _log.warning("zero_optimization.leaf_module matched no module of %s; every module is "
                     "gathered by zeroshard's own units", type(model).__name__)
    return list(marked.values())
