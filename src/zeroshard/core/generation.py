"""Generation at stage 3: `model.generate(...)` runs one forward per token, and gathering every unit
for each of them is most of its time. While the model fits (its sharded units together are at
most `stage3_max_live_parameters` elements), the whole call runs with every unit gathered once
(exact weights, also under qwZ) and released when it returns: its decode steps make no
collective, so ranks may generate different lengths, and a Hugging Face `generate` runs without
`synced_gpus` (one all-reduce per token saved) unless the caller asks for it. Otherwise each
forward gathers as in training, and with more than one rank `synced_gpus=True` is the default, so
a rank that finished its sequences keeps joining the gathers of the others instead of leaving
them waiting (DeepSpeed's ZeRO-3 behaviour).
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

#: The attribute holding the module's own `generate` while the stage-3 one is installed.
_ORIGINAL = "_zeroshard_generate"


def install(module: nn.Module, policy) -> None:
    """Give `module` (if it has a `generate` method) the stage-3 `generate` described above."""
    original = getattr(module, "generate", None)
    if original is None or not callable(original) or _ORIGINAL in module.__dict__:
        return
    takes_synced = "synced_gpus" in _parameters(original)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        numel = sum(policy.by_index[i].padded_numel for i in policy.sharded)
        if numel > policy.options.max_live_parameters:
            if takes_synced and policy.comm.world_size > 1:
                kwargs.setdefault("synced_gpus", True)
            return original(*args, **kwargs)
        if takes_synced:
            kwargs.setdefault("synced_gpus", False)  # no collective until it returns
        with policy.hold_all():
            return original(*args, **kwargs)

    # What to give back: an instance attribute of its own (a wrapper someone else installed), or
    # nothing (the class's method).
    module.__dict__[_ORIGINAL] = module.__dict__.get("generate")
    module.generate = generate


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
