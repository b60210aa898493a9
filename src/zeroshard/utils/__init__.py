"""DeepSpeed's `deepspeed.utils` names that training scripts use (`zero_to_fp32`)."""

from . import zero_to_fp32
from .zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "zero_to_fp32"]
