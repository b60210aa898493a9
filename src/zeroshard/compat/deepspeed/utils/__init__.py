"""DeepSpeed's `deepspeed.utils` names that training scripts and Hugging Face use: `zero_to_fp32`,
`logger` (a standard `logging.Logger`), the ZeRO-3 leaf marks (`set_z3_leaf_modules`), a
parameter's fp32 master, optimizer state and gradient, whole or this rank's piece, read and
written (`tensor_fragment`'s `safe_get_full_fp32_param` ... `safe_update_full_grad_vectorized`)."""

import logging

from . import tensor_fragment, zero_to_fp32
from .tensor_fragment import (safe_get_full_fp32_param, safe_get_full_grad,
                              safe_get_full_optimizer_state, safe_get_local_fp32_param,
                              safe_get_local_grad, safe_get_local_optimizer_state,
                              safe_set_full_fp32_param, safe_set_full_grad,
                              safe_set_full_optimizer_state, safe_set_local_fp32_param,
                              safe_set_local_grad, safe_set_local_optimizer_state,
                              safe_update_full_grad_vectorized)
from .z3_leaf import (get_z3_leaf_modules, set_z3_leaf_module, set_z3_leaf_modules,
                      set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
                      unset_z3_leaf_modules, z3_leaf_module)
from .zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

#: DeepSpeed's `deepspeed.utils.logger`: transformers sets its level from TrainingArguments.
logger = logging.getLogger("zeroshard")

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "get_z3_leaf_modules", "logger",
           *tensor_fragment.__all__, "set_z3_leaf_module",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "tensor_fragment", "unset_z3_leaf_modules", "z3_leaf_module", "zero_to_fp32"]
