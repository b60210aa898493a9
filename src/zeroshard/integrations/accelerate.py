"""`zeroshard.integrations.accelerate`, an old import path kept working: re-exports
`zeroshard.compat.accelerate`, the home of the Accelerate look-alike."""

from ..compat.accelerate.accelerator import (STATE_TAG, AcceleratedOptimizer,
                                             AcceleratedScheduler, Accelerator)  # noqa: F401
from ..compat.accelerate.config import DeepSpeedPlugin  # noqa: F401

__all__ = ["Accelerator", "AcceleratedOptimizer", "AcceleratedScheduler", "DeepSpeedPlugin"]
