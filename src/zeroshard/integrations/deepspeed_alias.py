"""`zeroshard.integrations.deepspeed_alias`, an old import path kept working: re-exports
`zeroshard.compat.deepspeed.alias`, the home of the launcher's `import deepspeed` alias."""

from ..compat.deepspeed.alias import (ALIASES, AREAS, DEEPSPEED_VERSION, RENAMED, DeepSpeedFinder,
                                      DeepSpeedModule, UnsupportedError, install, installed,
                                      missing, real_deepspeed_installed)  # noqa: F401
