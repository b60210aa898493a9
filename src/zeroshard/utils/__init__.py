"""`zeroshard.utils`: DeepSpeed's `deepspeed.utils` names (`logger`, `zero_to_fp32`, the ZeRO-3
leaf marks). An old import path kept working: it re-exports `zeroshard.compat.deepspeed.utils`."""

from . import z3_leaf, zero_to_fp32  # noqa: F401
from ..compat.deepspeed.utils import *  # noqa: F401,F403
from ..compat.deepspeed.utils import __all__  # noqa: F401
