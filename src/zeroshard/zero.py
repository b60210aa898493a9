"""DeepSpeed's `deepspeed.zero` namespace: `zero.Init` and `zero.GatheredParameters`."""

from .gathered import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
