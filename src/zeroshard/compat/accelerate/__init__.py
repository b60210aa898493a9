"""Accelerate's `Accelerator` and `DeepSpeedPlugin` on zeroshard (`accelerator.py`; the launcher's
`accelerate config` YAML in `config.py`, data loaders in `data.py`, rank helpers in `ranks.py`),
and `worker_hooks.py`, what `zeroshard run` changes in accelerate inside its workers.

`config.py` and `worker_hooks.py` are read by the launcher without the Accelerator: the names
below are imported on first use."""

_LAZY = {"Accelerator": ".accelerator", "DeepSpeedPlugin": ".config"}

__all__ = ["Accelerator", "DeepSpeedPlugin"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
