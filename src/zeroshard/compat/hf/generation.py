"""Generation at stage 3: `model.generate(...)` runs one forward per token, and gathering every unit
for each of them is most of its time. While the model fits (its sharded units together are at
most `stage3_max_live_parameters` elements), the whole call runs with every unit gathered once
(exact weights, also under qwZ) and released when it returns: its decode steps make no
collective, so ranks may generate different lengths, and a Hugging Face `generate` runs without
`synced_gpus` (one all-reduce per token saved) unless the caller asks for it. Otherwise each
forward gathers as in training, and with more than one rank `synced_gpus=True` is the default, so
a rank that finished its sequences keeps joining the gathers of the others instead of leaving
them waiting (DeepSpeed's ZeRO-3 behaviour).

Installed on every stage-3 model through core/extensions.py (zeroshard/__init__.py registers this
module): `install(view)` with the policy's read-only view (core/policy_view.py) gives the model
its `generate` and returns what takes it back at the engine's close.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from torch import nn

#: The attribute holding the module's own `generate` while the stage-3 one is installed.
_ORIGINAL = "_zeroshard_generate"


def install(view) -> Callable[[], None] | None:
    """Give the view's model (if it has a `generate` method) the stage-3 `generate` described
    above; returns what gives the model its own back (None: nothing was installed)."""
    module = view.module
    original = getattr(module, "generate", None) if module is not None else None
    if original is None or not callable(original) or _ORIGINAL in module.__dict__:
        return None
    takes_synced = "synced_gpus" in _parameters(original)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if not view.fits_whole():
            if takes_synced and view.world_size > 1:
                kwargs.setdefault("synced_gpus", True)
            return original(*args, **kwargs)
        if takes_synced:
            kwargs.setdefault("synced_gpus", False)  # no collective until it returns
        with view.hold_all():
            return original(*args, **kwargs)

    # What to give back: an instance attribute of its own (a wrapper someone else installed), or
    # nothing (the class's method).
    module.__dict__[_ORIGINAL] = module.__dict__.get("generate")
    module.generate = generate
    return functools.partial(uninstall, module)


def uninstall(module: nn.Module) -> None:
    """Give `module` its own `generate` back."""
    if _ORIGINAL not in module.__dict__:
        return
    own = module.__dict__.pop(_ORIGINAL)
    if own is None:
        module.__dict__.pop("generate", None)
    else:
        module.__dict__["generate"] = own


def _parameters(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
