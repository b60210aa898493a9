"""`zeroshard.consolidate`: consolidation's public import path (the code is in
`checkpoint/consolidate.py`)."""

from .checkpoint.consolidate import consolidate, consolidated_state_dict, tag_path  # noqa: F401
