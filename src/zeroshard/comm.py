"""`zeroshard.comm`: DeepSpeed's `deepspeed.comm` names. An old import path kept working: it
re-exports `zeroshard.compat.deepspeed.comm`, their home; zeroshard's own code imports
`zeroshard.dist`."""

from .compat.deepspeed.comm import *  # noqa: F401,F403
from .compat.deepspeed.comm import __all__  # noqa: F401
