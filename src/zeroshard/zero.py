"""`zeroshard.zero`: DeepSpeed's `deepspeed.zero` names. An old import path kept working: it
re-exports `zeroshard.compat.deepspeed.zero`, their home."""

from .compat.deepspeed.zero import *  # noqa: F401,F403
from .compat.deepspeed.zero import __all__  # noqa: F401
