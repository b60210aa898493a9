"""DeepSpeed's checkpoint files without DeepSpeed: its pickled classes read and written by name.

DeepSpeed saves its `*_states.pt` files with `torch.save`; besides tensors and plain containers
they pickle four DeepSpeed objects, which name DeepSpeed classes: the loss scaler
(`deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`), the ZeRO stage
(`deepspeed.runtime.zero.config.ZeroStageEnum`) and each parameter's slice of a partition
(`deepspeed.utils.tensor_fragment.fragment_address`). zeroshard never imports DeepSpeed:

- reading, `load()` runs `torch.load(weights_only=True)` (no code from the file runs) with exactly
  these four names mapped to stand-ins here, which keep the attributes DeepSpeed pickled;
- writing, `save()` pickles the stand-ins under DeepSpeed's names, so that DeepSpeed, which has
  the real classes, reads them back as its own objects.

Anything else a file references (another DeepSpeed class, an arbitrary callable) is refused by
`weights_only`, and `load()` says which file and what to do.
"""

from __future__ import annotations

import io
import os
import pickle
import types
from typing import Any, ClassVar

import torch

from .verify import CheckpointError

__all__ = ["DeepSpeedObject", "DynamicLossScaler", "FragmentAddress", "LossScaler", "ZeroStage",
           "load", "save"]


class DeepSpeedObject:
    """An instance of a DeepSpeed class, held without DeepSpeed: its pickled attributes."""

    ds_name: ClassVar[str] = ""

    def __init__(self, **attributes: Any):
        self.__dict__.update(attributes)

    def __repr__(self) -> str:
        return f"{self.ds_name.rsplit('.', 1)[-1]}({self.__dict__})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    __hash__ = None  # type: ignore[assignment]


def _stand_in(qualified: str) -> type:
    """A DeepSpeedObject subclass that stands for DeepSpeed's class `qualified`."""
    return type(qualified.rsplit(".", 1)[-1], (DeepSpeedObject,),
                {"ds_name": qualified, "__module__": __name__})


LossScaler = _stand_in("deepspeed.runtime.fp16.loss_scaler.LossScaler")
DynamicLossScaler = _stand_in("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")
FragmentAddress = _stand_in("deepspeed.utils.tensor_fragment.fragment_address")


class ZeroStage(int):
    """A member of DeepSpeed's `ZeroStageEnum` (an IntEnum), as the int it is."""

    ds_name: ClassVar[str] = "deepspeed.runtime.zero.config.ZeroStageEnum"

    def __reduce_ex__(self, protocol):
        return ZeroStage, (int(self),)  # DeepSpeed unpickles ZeroStageEnum(value)


_STAND_INS = (LossScaler, DynamicLossScaler, FragmentAddress, ZeroStage)


def load(path: str, mmap: bool = True) -> dict:
    """A DeepSpeed `*_states.pt` file as a dict, read with `weights_only=True` (memory-mapped:
    tensors are paged in when read); CheckpointError naming the file if it is missing,
    unreadable or references a class not known here."""
    if not os.path.isfile(path):
        raise CheckpointError(f"DeepSpeed checkpoint file missing: {path}")
    try:
        with torch.serialization.safe_globals([(cls, cls.ds_name) for cls in _STAND_INS]):
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as err:
                if not mmap or "mmap" not in str(err):
                    raise
                # torch.save's legacy (non-zip) format cannot be mapped: read it whole
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable or unsafe content
        first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} cannot be read safely ({first}). zeroshard reads "
            "the files DeepSpeed 0.19 writes for data-parallel ZeRO runs with weights_only=True; "
            "a file holding other objects (e.g. a custom optimizer's state) cannot be loaded") \
            from None
    if not isinstance(state, dict):
        raise CheckpointError(f"DeepSpeed checkpoint file {path} holds a {type(state).__name__}, "
                              "not the dict DeepSpeed writes")
    return state


class _NamedPickler(pickle._Pickler):  # noqa: SLF001 - the pure-Python one: save_global overridable
    """torch.save's pickler, writing the stand-ins under DeepSpeed's class names."""

    def save_global(self, obj, name=None):
        """A stand-in class by DeepSpeed's name; anything else as pickle does."""
        qualified = getattr(obj, "ds_name", None) if isinstance(obj, type) else None
        if not qualified:
            return super().save_global(obj, name)
        module, _, attribute = qualified.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(attribute)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{attribute}\n".encode())
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("zeroshard_deepspeed_pickle")  # what torch.save takes
_PICKLE_MODULE.Pickler = _NamedPickler


def save(state: dict, path: str) -> None:
    """Write `state` as DeepSpeed would (`torch.save`), the stand-ins under DeepSpeed's names."""
    buffer = io.BytesIO()
    torch.save(state, buffer, pickle_module=_PICKLE_MODULE)
    with open(path, "wb") as fh:
        fh.write(buffer.getvalue())
