"""DeepSpeed's ZeRO-3 "leaf module" marks (`deepspeed.utils.set_z3_leaf_modules` and friends): a
marked module is gathered whole at its forward, its submodules get no gather hooks of their own.
Here a marked module becomes one stage-3 unit (core/partition.py reads the mark), which is the
same thing; compat/deepspeed/utils/z3_leaf.py re-exports these under DeepSpeed's module path.
accelerate calls it for mixture-of-experts blocks, whose experts run in data-dependent order (a
different expert on each rank would otherwise gather different units, in different orders, and
hang).

Modules are chosen by class (a type matches its subclasses too; a string matches the class's
`__name__` or its fully-qualified `module.qualname`), by name (as `named_modules()` spells it) or
by name suffix, as in DeepSpeed 0.19.8, and so are the return values and the `ValueError` when
nothing matches (`raise_if_not_found=False` returns what matched instead). The config's
`zero_optimization.leaf_module` section (`classes`, `names`, `name_suffixes`) applies the same
marks at `initialize()` (`apply_leaf_module_config`).
"""

from __future__ import annotations

import logging

from torch import nn

LEAF_ATTR = "_z3_leaf"

_log = logging.getLogger("zeroshard")


def _qualified(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, classes) -> bool:
    for wanted in classes:
        if isinstance(wanted, type):
            if isinstance(module, wanted):
                return True
        elif wanted in (type(module).__name__, _qualified(module)):
            return True
    return False


def _check_classes(classes) -> None:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"set_z3_leaf_modules: leaf_module_classes must be classes or class names "
                        f"(e.g. [MixtralSparseMoeBlock] or ['MixtralSparseMoeBlock']); got {bad}")


def _mark_classes(model: nn.Module, classes, flag: bool, raise_if_not_found: bool, verb: str):
    _check_classes(classes)
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        names = [c.__name__ if isinstance(c, type) else c for c in classes]
        raise ValueError(f"{verb}: no module of class {names} in {type(model).__name__}; pass the "
                         "class (subclasses match too), its name or its module.qualname, or "
                         "raise_if_not_found=False")
    for module in found:
        setattr(module, LEAF_ATTR, flag)
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes,
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of these classes (types, class names or qualified names) as a leaf;
    returns them. Call it before `initialize()`: the stage-3 units are chosen there."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found,
                         "set_z3_leaf_modules")


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """Remove the leaf mark from the modules of these classes; returns them."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found,
                         "unset_z3_leaf_modules")


def set_z3_leaf_modules_by_name(model: nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True):
    """Set the leaf mark (`flag`) on the modules with these `named_modules()` names; returns
    (modules marked, names not found)."""
    by_name = dict(model.named_modules())
    found = [by_name[n] for n in module_names if n in by_name]
    missing = [n for n in module_names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in "
                         f"{type(model).__name__} (names as model.named_modules() gives them, e.g. "
                         f"{[n for n in by_name if n][:5]}), or pass raise_if_not_found=False")
    for module in found:
        setattr(module, LEAF_ATTR, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):
    """Set the leaf mark (`flag`) on every module whose `named_modules()` name ends with one of
    these suffixes; returns (modules marked, each once; suffixes that matched nothing)."""
    named = list(model.named_modules())
    found: dict[int, nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            found.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name in {type(model).__name__} "
                         f"ends with {missing}; pass raise_if_not_found=False to allow it")
    for module in found.values():
        setattr(module, LEAF_ATTR, flag)
    return list(found.values()), missing


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether the module is marked as a leaf."""
    return bool(getattr(module, LEAF_ATTR, False))


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Set or clear the leaf mark of this one module."""
    setattr(module, LEAF_ATTR, flag)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules of `model`."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def apply_leaf_module_config(model: nn.Module, section) -> list[nn.Module]:
    """Mark the modules the config's `zero_optimization.leaf_module` section names (`section`: its
    validated block, config/leaf_module.py); returns them, each once. Names and suffixes that
    match nothing, and a section written by the user that matches nothing at all, are logged as
    warnings (the defaults name Hugging Face MoE classes most models do not have: silent)."""
    if section is None:
        return []
    default = type(section)()
    marked: dict[int, nn.Module] = {}
    for module in set_z3_leaf_modules(model, section.classes, raise_if_not_found=False):
        marked.setdefault(id(module), module)
    for key, mark in (("names", set_z3_leaf_modules_by_name),
                      ("name_suffixes", set_z3_leaf_modules_by_suffix)):
        wanted = getattr(section, key)
        if not wanted:
            continue
        found, missing = mark(model, wanted, raise_if_not_found=False)
        for module in found:
            marked.setdefault(id(module), module)
        if missing and wanted != getattr(default, key):
            _log.warning("zero_optimization.leaf_module.%s: nothing in %s matches %s", key,
                         type(model).__name__, missing)
    if not marked and section != default:
        _log.warning("zero_optimization.leaf_module matched no module of %s; every module is "
                     "gathered by zeroshard's own units", type(model).__name__)
    return list(marked.values())
