"""DeepSpeed's `deepspeed.zero` namespace: `zero.Init`, `zero.GatheredParameters`, `ZeroParamStatus`,
`register_external_parameter`."""

from ...core.gathered import GatheredParameters
from ...core.init import Init, load_full_state_dict
from ...core.layout import ZeroParamStatus
from ...core.partition import register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "load_full_state_dict",
           "register_external_parameter"]
