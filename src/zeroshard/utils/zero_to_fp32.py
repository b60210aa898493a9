"""`zeroshard.utils.zero_to_fp32`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.utils.zero_to_fp32`, the home of these functions."""

from ..compat.deepspeed.utils.zero_to_fp32 import (  # noqa: F401
    convert_zero_checkpoint_to_fp32_state_dict, get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint)
