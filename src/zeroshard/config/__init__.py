"""The DeepSpeed-format config: schema and loading (`schema.py`), optimizer hyper-parameter checks
(`optimizer.py`), the keys accepted with a "no effect" notice (`inert.py`), and "auto" values
(`auto.py`). `zeroshard.config` exposes the schema's public names."""

from .schema import *  # noqa: F401,F403
from .schema import __all__, read_raw  # noqa: F401
