"""DeepSpeed's `deepspeed.utils` names that training scripts and Hugging Face use: `zero_to_fp32`,
`logger` (a standard `logging.Logger`), the ZeRO-3 leaf marks (`set_z3_leaf_modules`)."""

import logging

from . import zero_to_fp32
from .z3_leaf import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
from .zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

#: DeepSpeed's `deepspeed.utils.logger`: transformers sets its level from TrainingArguments.
logger = logging.getLogger("zeroshard")

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "get_z3_leaf_modules", "logger",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module", "zero_to_fp32"]
