"""`zeroshard.accelerator`: DeepSpeed's `deepspeed.accelerator` namespace under DESIGN.md's public
path (`from zeroshard.accelerator import get_accelerator`); importing it gives its home,
`zeroshard.compat.deepspeed.accelerator`."""

import sys

from .compat.deepspeed import accelerator as _home

# The same module object under both names (see integrations/hf.py), as under the launcher's alias.
sys.modules[__name__] = _home
