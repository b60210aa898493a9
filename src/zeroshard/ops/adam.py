"""`zeroshard.ops.adam`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.ops.adam`, the home of these names."""

from ..compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
