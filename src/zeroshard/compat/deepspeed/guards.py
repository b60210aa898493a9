"""What a partitioned stage-3 parameter refuses to do silently (installed by surface.py).

Between gathers a stage-3 parameter is an empty tensor (its real size is in `ds_shape`). Two
ordinary PyTorch calls would then write something that does not load, without a word:

* `torch.save(param)` (or pickling a module) stores the empty tensor, and with it every Python
  attribute on the parameter, zeroshard's internals included. Here each parameter pickles
  without zeroshard's attributes, and raises `PartitionedStateError` while released.
* `module.state_dict()` returns the empty tensors. It warns (`PartitionedStateWarning`, naming
  the parameters and the two ways to get whole values) rather than raising: it is often called on
  one rank for the names alone, and DeepSpeed-Chat's `save_hf_format` saves it on rank 0 right
  before `save_zero_three_model` overwrites the file with gathered weights. An error there would
  stop a script that ends with a good file; the warning still says what went wrong when nothing
  overwrites it.

Inside `GatheredParameters` (or any gather) both calls see the whole values, quietly.
"""

from __future__ import annotations

import warnings
import weakref

from torch import nn

from ...core.layout import ZeroParamStatus

_HOW = ("gather them first: read inside `with zeroshard.GatheredParameters(model.parameters()):` "
        "(DeepSpeed: deepspeed.zero.GatheredParameters) on every rank, or call "
        "engine.consolidated_state_dict() / engine._zero3_consolidated_16bit_state_dict() on "
        "every rank for the whole model")


class PartitionedStateError(RuntimeError):
    """A stage-3 parameter holding only this rank's shard was about to be saved as if whole."""


class PartitionedStateWarning(UserWarning):
    """state_dict() returned stage-3 parameters that hold only this rank's shard (empty)."""


def _released(param) -> bool:
    return getattr(param, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE


def guard_state_dict(module: nn.Module) -> "object":
    """Make `module.state_dict()` warn (once per call) when it returns released parameters;
    returns the hook handle (remove it to lift the guard). Every module of a model gets one, so
    that a submodule's own state_dict() is covered too: the module it was called on checks its
    whole subtree (its call is the one with an empty prefix)."""

    def check(mod, state_dict, prefix, local_metadata):
        if prefix:
            return
        # keep_vars=True hands back the live Parameter objects (their names are what is wanted).
        empty = [(name, p) for name, p in mod.named_parameters()
                 if _released(p) and name in state_dict and state_dict[name] is not p]
        if empty:
            name, param = empty[0]
            more = f" and {len(empty) - 1} more" if len(empty) > 1 else ""
            warnings.warn(PartitionedStateWarning(
                f"state_dict() of a ZeRO stage-3 model: {name!r} (shape "
                f"{tuple(param.ds_shape)}){more} hold only this rank's shard and are returned "
                f"empty; saved as they are they will not load. To get whole values, {_HOW}"),
                stacklevel=3)

    return module.register_state_dict_post_hook(check)


def guard_pickling(param: nn.Parameter) -> None:
    """Make pickling `param` (torch.save) drop zeroshard's attributes, and refuse while released."""
    if "__getstate__" in param.__dict__:
        return
    ref = weakref.ref(param)

    def getstate():
        owner = ref()
        if owner is None:
            return {}
        if _released(owner):
            raise PartitionedStateError(
                f"torch.save / pickle of a ZeRO stage-3 parameter of shape "
                f"{tuple(owner.ds_shape)}: it holds only this rank's shard and would be saved "
                f"empty; {_HOW}")
        return {k: v for k, v in owner.__dict__.items()
                if not k.startswith(("_zeroshard", "ds_")) and k != "__getstate__"}

    # torch pickles a Parameter's Python attributes through `param.__getstate__()`, looked up on
    # the instance first (torch._utils._get_obj_state).
    param.__getstate__ = getstate
