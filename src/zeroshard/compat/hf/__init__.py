"""Hugging Face on zeroshard: `ZeroTrainer` (`trainer.py`), stage-3 loading (`load.py`:
`from_pretrained`, `from_config`), and transformers' weight init inside `zeroshard.Init`
(`init.py`, which never imports transformers; core reaches it through a registered hook).

The names below import transformers, so they are imported on first use."""

_LAZY = {"ZeroTrainer": ".trainer", "resolve_hf_config": ".trainer",
         "from_pretrained": ".load", "from_config": ".load"}

__all__ = ["ZeroTrainer", "from_config", "from_pretrained", "resolve_hf_config"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
