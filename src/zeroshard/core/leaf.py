"""DeepSpeed's ZeRO-3 "leaf module" marks (`deepspeed.utils.set_z3_leaf_modules`): a marked module
is gathered whole at its forward, its submodules get no gather hooks of their own. Here a marked
module becomes one stage-3 unit (core/partition.py reads the mark), which is the same thing.
accelerate calls it for mixture-of-experts blocks, whose experts run in data-dependent order."""

from __future__ import annotations

from torch import nn

LEAF_ATTR = "_z3_leaf"


def _matches(module: nn.Module, classes) -> bool:
    names = {c if isinstance(c, str) else c.__name__ for c in classes}
    return type(module).__name__ in names


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list[nn.Module]:
    """Mark every module of these classes (types or class names) as a leaf; returns them.
    Call it before `initialize()`: the stage-3 units are chosen there."""
    found = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    if not found:
        raise ValueError(f"set_z3_leaf_modules: no module of class "
                         f"{[getattr(c, '__name__', c) for c in leaf_module_classes]} in "
                         f"{type(model).__name__}")
    for module in found:
        setattr(module, LEAF_ATTR, True)
    return found


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes) -> list[nn.Module]:
    """Remove the leaf mark from the modules of these classes; returns them."""
    found = [m for m in model.modules() if _matches(m, leaf_module_classes)]
    for module in found:
        setattr(module, LEAF_ATTR, False)
    return found


def z3_leaf_module(module: nn.Module) -> bool:
    """Whether the module is marked as a leaf."""
    return bool(getattr(module, LEAF_ATTR, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules of `model`."""
    return [m for m in model.modules() if z3_leaf_module(m)]
