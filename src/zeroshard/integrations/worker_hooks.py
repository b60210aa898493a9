"""`zeroshard.integrations.worker_hooks`, an old import path kept working: re-exports
`zeroshard.compat.accelerate.worker_hooks`, their home (the launcher's workers load that file
by path)."""

from ..compat.accelerate.worker_hooks import (ACCELERATE_DEEPSPEED, PATCHES,
                                              AccelerateDeepSpeedError, PatchFinder, install,
                                              patch_accelerate_state)  # noqa: F401
