"""`zeroshard.accelerator`: DeepSpeed's `deepspeed.accelerator` namespace. An old import path kept
working: it re-exports `zeroshard.compat.deepspeed.accelerator`, its home."""

from .compat.deepspeed.accelerator import *  # noqa: F401,F403
from .compat.deepspeed.accelerator import __all__  # noqa: F401
