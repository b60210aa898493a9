"""The DeepSpeed-format config: schema and loading (`schema.py`), optimizer hyper-parameter checks
(`optimizer.py`), the keys accepted with a "no effect" notice (`inert.py`), and "auto" values
(`auto.py`), and every refusal of a setting the engine cannot run (`refusals.py`).
`zeroshard.config` exposes the schema's public names and `require_supported`."""

from .refusals import require_supported  # noqa: F401
from .schema import *  # noqa: F401,F403
from .schema import __all__ as _schema_all, read_raw  # noqa: F401

__all__ = [*_schema_all, "require_supported"]
