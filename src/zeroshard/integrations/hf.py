"""`zeroshard.integrations.hf`: the documented path of `zeroshard.compat.hf` (`ZeroTrainer`,
`from_pretrained`, `from_config`), which is what importing it gives."""

import sys

from ..compat import hf as _home

# The same module object under both names: its names (imported on first use, so transformers is
# not imported here) cannot drift from a re-exported list, and isinstance checks agree.
sys.modules[__name__] = _home
