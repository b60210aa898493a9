"""`zeroshard.integrations.hf_load`, an old import path kept working: re-exports
`zeroshard.compat.hf.load`, the home of stage-3 loading."""

from ..compat.hf.load import (BIN_INDEX, BIN_SINGLE, PickleEntry, from_config, from_pretrained,
                              plan_load, stream_weights)  # noqa: F401
