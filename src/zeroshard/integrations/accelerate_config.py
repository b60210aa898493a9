"""`zeroshard.integrations.accelerate_config`, an old import path kept working: re-exports
`zeroshard.compat.accelerate.config` (accelerate's YAML and DeepSpeedPlugin), their home."""

from ..compat.accelerate.config import (ENV, LAUNCH_ENV, PRECISIONS, SETTINGS, AccelerateConfig,
                                        DeepSpeedPlugin, build_deepspeed_config, check_precision,
                                        launch_env, read_accelerate_config,
                                        zero3_init_flag)  # noqa: F401
