"""`zeroshard.cli.deepspeed_flags`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.launcher_flags`, the home of DeepSpeed's launcher flags."""

from ..compat.deepspeed.launcher_flags import (  # noqa: F401
    __all__, add_arguments, apply, core_assignment, imports_deepspeed, read_hostfile)
