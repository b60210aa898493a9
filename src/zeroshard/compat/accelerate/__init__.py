"""Accelerate's `Accelerator` and `DeepSpeedPlugin` on zeroshard (`accelerator.py`; the launcher's
`accelerate config` YAML in `config.py`, data loaders in `data.py`, rank helpers in `ranks.py`),
and `worker_hooks.py`, what `zeroshard run` changes in accelerate inside its workers.

`config.py` and `worker_hooks.py` are read by the launcher without the Accelerator: the names
below are imported on first use."""

from ..lazy import lazy_names

_LAZY = {"Accelerator": ".accelerator", "DeepSpeedPlugin": ".config"}

__all__ = ["Accelerator", "DeepSpeedPlugin"]


__getattr__ = lazy_names(__name__, _LAZY, globals())
