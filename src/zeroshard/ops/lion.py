"""`zeroshard.ops.lion`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.ops.lion`, the home of these names."""

from ..compat.deepspeed.ops.lion import DeepSpeedCPULion, FusedLion, Lion  # noqa: F401
