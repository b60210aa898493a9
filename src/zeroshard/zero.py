"""DeepSpeed's `deepspeed.zero` namespace: `zero.Init` and `zero.GatheredParameters`."""

from .gathered import GatheredParameters
from .init import Init, load_full_state_dict

__all__ = ["GatheredParameters", "Init"]
