"""Which ZeroOptimizer and unit manage a parameter: a registry keyed by the parameter's identity,
instead of attributes written onto parameters.

`GatheredParameters(params)`, `load_full_state_dict` and the Hugging Face helpers get only the
parameters (DeepSpeed's API), so they look their owner up here. Entries hold the optimizer, the
unit and the Comm weakly (and the key is weak): an engine dropped without `destroy()` is freed as
before, and its parameters then count as unmanaged. `world_comm` is the Comm that numbers the world for a
`modifier_rank` broadcast (under MiCS the optimizer's own Comm is only its shard group).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from torch.utils.weak import WeakIdKeyDictionary

from ..dist import Comm

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


class Owner(NamedTuple):
    """A managed parameter's optimizer, unit and world Comm."""

    optimizer: object
    unit: object
    world_comm: Comm


def register(optimizer, unit, world_comm: Comm) -> None:
    """Record that `optimizer` manages the parameters of `unit`."""
    # All weak: a Comm's watchdog keeps its last collective's unit (and so its parameters).
    entry = (weakref.ref(optimizer), weakref.ref(unit), weakref.ref(world_comm))
    for param in unit.params():
        _OWNERS[param] = entry


def owner_of(param) -> Owner | None:
    """The live owner of `param`, or None (unmanaged, closed, or its engine was dropped)."""
    entry = _OWNERS.get(param)
    if entry is None:
        return None
    optimizer, unit = entry[0](), entry[1]()
    if optimizer is None or unit is None:
        return None
    return Owner(optimizer, unit, entry[2]() or optimizer.comm)


def is_managed(param) -> bool:
    """Whether a live ZeroOptimizer manages `param`."""
    return owner_of(param) is not None


def forget(unit) -> None:
    """Drop the entries of `unit`'s parameters (the optimizer is closing)."""
    for param in unit.params():
        _OWNERS.pop(param, None)
