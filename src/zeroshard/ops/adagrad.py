"""`zeroshard.ops.adagrad`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.ops.adagrad`, the home of these names."""

from ..compat.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad  # noqa: F401
