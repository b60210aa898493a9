"""DeepSpeed's `deepspeed.zero` namespace: `zero.Init`, `zero.GatheredParameters`, `ZeroParamStatus`."""

from .core.gathered import GatheredParameters
from .core.init import Init, load_full_state_dict
from .core.layout import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "load_full_state_dict"]
