"""`zeroshard.integrations.hf`, an old import path kept working (the docs' `ZeroTrainer`,
`from_pretrained`): re-exports `zeroshard.compat.hf.trainer` and `.load`, their home."""

from ..compat.hf.trainer import (STATE_NAME, HfZero3Config, ZeroTrainer, hf_known,
                                 last_checkpoint, resolve_hf_config, zero3_announced)  # noqa: F401
from ..compat.hf.load import from_config, from_pretrained  # noqa: F401
