"""`import deepspeed` under `zeroshard run`: DeepSpeed's module names answered by zeroshard.

`zeroshard run` puts the directory holding a two-line `deepspeed.py` (`_deepspeed_shim/`) first
on its workers' PYTHONPATH when DeepSpeed is not installed (or with `--alias-deepspeed`), so an
unchanged script's `import deepspeed` loads that file, which calls `install()`:

* `sys.modules["deepspeed"]` becomes a module that answers with zeroshard's names
  (`deepspeed.initialize is zeroshard.initialize`, `deepspeed.comm` is `compat/deepspeed/comm.py`'s
  names);
* a finder first on `sys.meta_path` answers every `deepspeed.<x>` import: DeepSpeed's paths that
  zeroshard implements (ALIASES) by a module forwarding to the zeroshard module, so the objects
  (and the process group behind them) are the same; any other path by a stand-in module.
* A name zeroshard does not have, in any of these modules, is a stand-in class: importing it
  works (DeepSpeed's CIFAR-10 example imports `deepspeed.moe.utils` at the top and uses it only
  behind `--moe`), `isinstance` against it is False, and calling it, instantiating it or using
  it as a base raises `UnsupportedError` naming it (`deepspeed.moe.layer.MoE is not supported by
  zeroshard (mixture of experts) ...`).

The same directory holds `deepspeed-<DEEPSPEED_VERSION>.dist-info`, so packages that check for
DeepSpeed by its installed metadata (transformers, accelerate, TRL) find it in the workers and
take their DeepSpeed paths, and a `sitecustomize.py` that loads compat/accelerate/worker_hooks.py.

`python script.py` outside the launcher never runs this: there `import deepspeed` still needs to
be written `import zeroshard as deepspeed`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

#: The DeepSpeed release whose API zeroshard answers, marked as ours (PEP 440 local version): what
#: `deepspeed.__version__` and the shim's package metadata (`importlib.metadata.version`) say.
DEEPSPEED_VERSION = "0.19.8+zeroshard"

#: DeepSpeed module paths zeroshard implements, and the zeroshard module that answers each.
ALIASES = {
    "deepspeed": "zeroshard",
    "deepspeed.accelerator": "zeroshard.compat.deepspeed.accelerator",
    "deepspeed.comm": "zeroshard.compat.deepspeed.comm",
    "deepspeed.zero": "zeroshard.compat.deepspeed.zero",
    "deepspeed.ops": "zeroshard.compat.deepspeed.ops",
    "deepspeed.ops.adam": "zeroshard.compat.deepspeed.ops.adam",
    "deepspeed.ops.op_builder": "zeroshard.compat.deepspeed.ops.op_builder",
    "deepspeed.utils": "zeroshard.compat.deepspeed.utils",
    "deepspeed.utils.zero_to_fp32": "zeroshard.compat.deepspeed.utils.zero_to_fp32",
    "deepspeed.utils.z3_leaf_module": "zeroshard.compat.deepspeed.utils.z3_leaf",
    "deepspeed.utils.tensor_fragment": "zeroshard.compat.deepspeed.utils.tensor_fragment",
    "deepspeed.checkpoint.utils": "zeroshard.checkpoint.clone",
    "deepspeed.moe.utils": "zeroshard.compat.deepspeed.moe_utils",
    "deepspeed.utils.torch": "zeroshard.compat.deepspeed.utils.torch_version",
    "deepspeed.ops.adagrad": "zeroshard.compat.deepspeed.ops.adagrad",
    "deepspeed.ops.lion": "zeroshard.compat.deepspeed.ops.lion",
    "deepspeed.runtime.zero": "zeroshard.compat.deepspeed.zero",
    "deepspeed.runtime.zero.partition_parameters": "zeroshard.compat.deepspeed.zero",
    "deepspeed.runtime.zero.stage3": "zeroshard.compat.deepspeed.zero",
    "deepspeed.runtime.zero.mics": "zeroshard.compat.deepspeed.zero",
    "deepspeed.runtime.zero.config": "zeroshard.compat.deepspeed.zero_config",
    "deepspeed.runtime.zero.offload_config": "zeroshard.compat.deepspeed.zero_config",
    "deepspeed.runtime.zero.leaf_module_config": "zeroshard.config.leaf_module",
    "deepspeed.runtime.swap_tensor": "zeroshard.compat.deepspeed.swap_tensor",
    "deepspeed.git_version_info": "zeroshard.compat.deepspeed.git_version_info",
    "deepspeed.runtime.lr_schedules": "zeroshard.schedulers",
    "deepspeed.runtime.engine": "zeroshard.engine",
    "deepspeed.checkpointing": "zeroshard.activations.checkpointing",
    "deepspeed.runtime.activation_checkpointing": "zeroshard.activations",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "zeroshard.activations.checkpointing",
    "deepspeed.monitor": "zeroshard.monitor",
    "deepspeed.monitor.monitor": "zeroshard.monitor.writers",
}
#: DeepSpeed names with another spelling here: {module: {name: (zeroshard module, attribute)}}.
RENAMED = {
    "deepspeed": {"DeepSpeedEngine": ("zeroshard.engine", "Engine"),
                  "DeepSpeedConfigError": ("zeroshard.config.schema", "ConfigError")},
    "deepspeed.runtime.engine": {"DeepSpeedEngine": ("zeroshard.engine", "Engine")},
    "deepspeed.runtime.zero.leaf_module_config": {
        "DeepSpeedZeroLeafModuleConfig": ("zeroshard.config.leaf_module", "LeafModuleConfig")},
}
#: What the most used unsupported areas are, for the error message.
AREAS = {"moe": "mixture of experts", "pipe": "pipeline parallelism",
         "inference": "DeepSpeed's inference engine", "init_inference": "DeepSpeed's inference engine",
         "sequence": "sequence parallelism", "compression": "model compression",
         "module_inject": "kernel injection", "launcher": "DeepSpeed's launcher; use zeroshard run",
         "autotuning": "autotuning", "profiling": "DeepSpeed's profiler classes; set the config's "
         "flops_profiler section instead"}


class UnsupportedError(NotImplementedError):
    """A DeepSpeed name zeroshard does not implement was used (the message names it)."""


class _Missing(type):
    """Metaclass of stand-ins: any attribute is a further stand-in, any use raises."""

    def __call__(cls, *args, **kwargs):
        raise UnsupportedError(_message(cls._zs_name))

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return missing(f"{cls._zs_name}.{name}")

    def __instancecheck__(cls, obj) -> bool:
        return False

    def __subclasscheck__(cls, sub) -> bool:
        return sub is cls

    def __repr__(cls) -> str:
        return f"<{cls._zs_name}: not supported by zeroshard>"


def missing(dotted: str) -> type:
    """A stand-in for the DeepSpeed name `dotted`: importable, failing when used."""
    module, _, name = dotted.rpartition(".")
    return _Missing(name, (), {"_zs_name": dotted, "__module__": module, "__qualname__": name})


def _message(dotted: str) -> str:
    area = next((AREAS[p] for p in dotted.split(".")[1:] if p in AREAS), None)
    what = f" ({area})" if area else ""
    return (f"{dotted} is not supported by zeroshard{what}: its DeepSpeed drop-in covers ZeRO "
            "training (deepspeed.initialize, zero, comm, accelerator, ops.adam, utils.zero_to_fp32; "
            "see docs/migrating-from-deepspeed.md). Remove this use, or run the script under "
            "DeepSpeed itself")


class DeepSpeedModule(types.ModuleType):
    """`deepspeed.<x>`: zeroshard's module's names (`target`), and stand-ins for the rest."""

    def __init__(self, name: str, target: types.ModuleType | None):
        super().__init__(name, getattr(target, "__doc__", None))
        self.__dict__["_zs_target"] = target
        self.__path__ = []  # a package: deepspeed.<x>.<y> imports go through the finder

    def __getattr__(self, name: str):
        full = f"{self.__name__}.{name}"
        renamed = RENAMED.get(self.__name__, {}).get(name)
        if renamed is not None:
            return getattr(importlib.import_module(renamed[0]), renamed[1])
        target = self.__dict__["_zs_target"]
        if _reexported(target, name) is not None:
            return getattr(target, name)
        if full in ALIASES or any(alias.startswith(full + ".") for alias in ALIASES):
            return importlib.import_module(full)  # e.g. deepspeed.runtime, on the way to .zero
        if target is not None and hasattr(target, name):
            return getattr(target, name)
        if name.startswith("_"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return missing(full)

    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule deepspeed.utils.z3_leaf_module sets it as an attribute of its
        # parent; DeepSpeed's package re-exports a function under that name, which stays.
        if isinstance(value, types.ModuleType) and \
                _reexported(self.__dict__.get("_zs_target"), name) is not None:
            return
        super().__setattr__(name, value)

    def __dir__(self):
        target = self.__dict__["_zs_target"]
        return sorted(set(super().__dir__()) | set(dir(target) if target is not None else ()))


def _reexported(target: types.ModuleType | None, name: str):
    """`target`'s attribute `name` when it is not a module (a function DeepSpeed's package
    re-exports under its submodule's name, as `deepspeed.utils.z3_leaf_module`), else None."""
    value = getattr(target, name, None) if target is not None else None
    return None if value is None or isinstance(value, types.ModuleType) else value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        """A DeepSpeedModule over the zeroshard module that answers `spec.name` (or none)."""
        target = ALIASES.get(spec.name)
        module = DeepSpeedModule(spec.name, importlib.import_module(target) if target else None)
        if spec.name == "deepspeed":
            major, minor, patch = DEEPSPEED_VERSION.split("+")[0].split(".")
            module.__dict__.update(__version__=DEEPSPEED_VERSION, __version_major__=int(major),
                                   __version_minor__=int(minor), __version_patch__=int(patch),
                                   __git_hash__="zeroshard", __git_branch__="zeroshard")
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: the module answers through zeroshard's."""


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Answers every `deepspeed` and `deepspeed.<x>` import with a DeepSpeedModule."""

    def find_spec(self, fullname, path=None, target=None):
        """A spec for DeepSpeed's names, None for anything else."""
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(), is_package=True)


def install() -> types.ModuleType:
    """Make `deepspeed` and `deepspeed.<x>` answer with zeroshard's modules (idempotent); returns
    the `deepspeed` module."""
    if not any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedFinder())
    module = sys.modules.get("deepspeed")
    if not isinstance(module, DeepSpeedModule):
        spec = DeepSpeedFinder().find_spec("deepspeed")
        module = importlib.util.module_from_spec(spec)
        sys.modules["deepspeed"] = module
    return module


def real_deepspeed_installed() -> bool:
    """Whether `import deepspeed` would load DeepSpeed itself (not this alias or its shim)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) or ""
    return spec is not None and not isinstance(spec.loader, _Loader) and \
        "_deepspeed_shim" not in origin


def installed() -> bool:
    """Whether `deepspeed` names zeroshard in this process."""
    return isinstance(sys.modules.get("deepspeed"), DeepSpeedModule)
