"""DeepSpeed's `deepspeed.zero` namespace: `zero.Init`, `zero.GatheredParameters`, `ZeroParamStatus`."""

from .gathered import GatheredParameters
from .init import Init, load_full_state_dict
from .layout import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "load_full_state_dict"]
