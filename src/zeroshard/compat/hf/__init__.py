"""Hugging Face on zeroshard: `ZeroTrainer` (`trainer.py`), stage-3 loading (`load.py`:
`from_pretrained`, `from_config`), and transformers' weight init inside `zeroshard.Init`
(`init.py`, which never imports transformers; core reaches it through a registered hook).

The names below import transformers, so they are imported on first use."""

from ..lazy import lazy_names

_LAZY = {"ZeroTrainer": ".trainer", "resolve_hf_config": ".trainer",
         "from_pretrained": ".load", "from_config": ".load"}

__all__ = ["ZeroTrainer", "from_config", "from_pretrained", "resolve_hf_config"]


__getattr__ = lazy_names(__name__, _LAZY, globals())
