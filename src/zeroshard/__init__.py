"""zeroshard: ZeRO (Zero Redundancy Optimizer) for PyTorch, DeepSpeed-config compatible.

What exists to look like another library (DeepSpeed's `zero`, `comm`, `accelerator`, `ops`,
`utils`; Accelerate's `Accelerator`; Hugging Face; Lightning) lives in `compat/` and is imported
on first use: `import zeroshard` loads none of it.
"""

import argparse as _argparse
import sys as _sys

from .dist import init_distributed
from .config.schema import ConfigError, NotSupportedYetError, load_config
from .build import initialize, is_initialized, prepare
from .engine import Engine
from .core.gathered import GatheredParameters
from .core.init import Init, load_full_state_dict, register_library_hooks
from .core.extensions import register as _register_extension
from .core.agreement import RankMismatchError
from .dist.steps import DesyncError
from .core.optim import NonFiniteGradientError, ZeroOptimizer
from .core.scaler import LossScaleError

__version__ = "0.1.0"

#: Names imported on first use (compat/): a DeepSpeed-style script needs no Accelerate look-alike.
_LAZY = {"Accelerator": "zeroshard.compat.accelerate",
         "DeepSpeedPlugin": "zeroshard.compat.accelerate",
         "get_accelerator": "zeroshard.compat.deepspeed.accelerator"}
#: Submodules under DeepSpeed's names (`import zeroshard as deepspeed; deepspeed.checkpointing`,
#: `deepspeed.comm`, `deepspeed.zero`), imported on first use from their homes: the same modules
#: the launcher's `import deepspeed` alias (compat/deepspeed/alias.py) maps these names to.
_LAZY_MODULES = {"checkpointing": "zeroshard.activations.checkpointing",
                 "monitor": "zeroshard.monitor",
                 "accelerator": "zeroshard.accelerator",
                 "comm": "zeroshard.compat.deepspeed.comm", "ops": "zeroshard.compat.deepspeed.ops",
                 "utils": "zeroshard.compat.deepspeed.utils",
                 "zero": "zeroshard.compat.deepspeed.zero"}


def _hf_init_hooks():
    """compat/hf/init.py once transformers' models exist (it never imports transformers): Init
    runs their own weight init on gathered parameters (core/init.py's LibraryHooks)."""
    modeling = _sys.modules.get("transformers.modeling_utils")
    if getattr(modeling, "PreTrainedModel", None) is None:
        return None
    from .compat.hf import init
    return init


register_library_hooks(_hf_init_hooks)


def _deepspeed_surface():
    """compat/deepspeed/surface.py, imported when core first announces something to its
    extensions (a stage-3 engine or Init unit): DeepSpeed's `ds_*` attributes, save guards,
    `ds_external_parameters` and `parameter_offload` (core/extensions.py)."""
    from .compat.deepspeed import surface
    return surface


def _hf_generation():
    """compat/hf/generation.py, imported with the one above: a stage-3 model's `generate` runs
    with the whole model gathered once while it fits."""
    from .compat.hf import generation
    return generation


_register_extension(_deepspeed_surface)
_register_extension(_hf_generation)


def __getattr__(name):
    """The compat names (`zeroshard.Accelerator`, `get_accelerator`, `zeroshard.comm`, ...) and
    `checkpointing` / `monitor`, imported when first asked for."""
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


def add_config_arguments(parser):
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` options to an argparse parser."""
    group = parser.add_argument_group("zeroshard", "zeroshard / DeepSpeed configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable zeroshard (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", "--zeroshard_config", default=None, type=str,
                       help="path to a DeepSpeed-format JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=_argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=_argparse.SUPPRESS)
    return parser


__all__ = [
    "Accelerator", "DeepSpeedPlugin", "ConfigError", "DesyncError", "RankMismatchError", "Engine", "GatheredParameters", "Init", "LossScaleError",
    "NonFiniteGradientError", "NotSupportedYetError", "ZeroOptimizer", "add_config_arguments", "init_distributed", "initialize", "is_initialized",
    "load_config", "load_full_state_dict", "prepare", "accelerator", "comm", "get_accelerator",
    "ops", "utils", "zero", "__version__",
]
