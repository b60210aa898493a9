"""`deepspeed.utils.z3_leaf_module`: DeepSpeed's ZeRO-3 leaf-module functions over core/leaf.py's
marks (stage 3 reads them when it chooses its units: a marked module is one unit). Accelerate calls
`set_z3_leaf_modules` for mixture-of-experts blocks. Call them before `initialize()`.

Modules are chosen by class (a type matches its subclasses too; a string matches the class's
`__name__` or its `module.qualname`), by name or by name suffix, as in DeepSpeed 0.19.8, and so
are the return values and the `ValueError` when nothing matches (`raise_if_not_found=False`
returns what matched instead).
"""

from __future__ import annotations

from torch import nn

from ....core.leaf import is_leaf, mark, modules_named, modules_of_classes, modules_with_suffixes


def _check_classes(classes) -> None:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"set_z3_leaf_modules: leaf_module_classes must be classes or class names "
                        f"(e.g. [MixtralSparseMoeBlock] or ['MixtralSparseMoeBlock']); got {bad}")


def _mark_classes(model: nn.Module, classes, flag: bool, raise_if_not_found: bool, verb: str):
    _check_classes(classes)
    found = modules_of_classes(model, classes)
    if not found and raise_if_not_found:
        names = [c.__name__ if isinstance(c, type) else c for c in classes]
        raise ValueError(f"{verb}: no module of class {names} in {type(model).__name__}; pass the "
                         "class (subclasses match too), its name or its module.qualname, or "
                         "raise_if_not_found=False")
    mark(found, flag)
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
    found, missing = modules_named(model, module_names)
    if missing and raise_if_not_found:
        shown = [n for n, _ in model.named_modules() if n][:5]
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in "
                         f"{type(model).__name__} (names as model.named_modules() gives them, e.g. "
                         f"{shown}), or pass raise_if_not_found=False")
    mark(found, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):
    """Set the leaf mark (`flag`) on every module whose `named_modules()` name ends with one of
    these suffixes; returns (modules marked, each once; suffixes that matched nothing)."""
    found, missing = modules_with_suffixes(model, module_name_suffixes)
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name in {type(model).__name__} "
                         f"ends with {missing}; pass raise_if_not_found=False to allow it")
    mark(found, flag)
    return found, missing


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether the module is marked as a leaf."""
    return is_leaf(module)


def set_z3_leaf_module(module: nn.Module, flag: bool) -> None:
    """Set or clear the leaf mark of this one module."""
    mark([module], flag)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules of `model`."""
    return [m for m in model.modules() if is_leaf(m)]
