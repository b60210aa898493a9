"""`zeroshard.integrations.lightning`: the documented path of `zeroshard.compat.lightning`
(`ZeroShardStrategy`), which is what importing it gives."""

import sys

from ..compat import lightning as _home

# The same module object under both names (see hf.py).
sys.modules[__name__] = _home
