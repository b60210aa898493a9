"""What `zeroshard run` changes in its workers at interpreter start, and nothing else.

The launcher sets ZEROSHARD_WORKER_HOOKS=1 next to the `import deepspeed` alias; the shim's
`sitecustomize.py` then loads this file before the script runs. It imports neither torch nor
zeroshard, and patches only when the library concerned is imported:

* **accelerate on a CPU-only host.** With `ACCELERATE_USE_DEEPSPEED=true` (an accelerate config
  with `distributed_type: DEEPSPEED`, or transformers' `--deepspeed`), accelerate's
  `PartialState` finds no accelerator, picks no backend and then counts one process per
  worker: every rank trains alone on all the data (real DeepSpeed fails the same way there).
  Here that one case gets the gloo backend, so accelerate counts the real world, DeepSpeed's
  `init_distributed` (zeroshard's) starts gloo, and the state becomes DEEPSPEED. With an
  accelerator present, or without DeepSpeed asked for, accelerate is left alone.
* **Never silent.** When the launcher's accelerate config asked for DeepSpeed
  (ZEROSHARD_ACCELERATE_DEEPSPEED=<yaml path>) and accelerate's state still ends up without it
  (`Accelerator(cpu=True)`, or `ACCELERATE_USE_CPU`), the worker stops with an error saying so.
  And `initialize()` leaves a mark for the launcher (process_group.mark_engaged), which fails a
  job that was handed a DeepSpeed config and ended without any worker building an engine.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

#: Set by the launcher when its accelerate config says `distributed_type: DEEPSPEED`.
ACCELERATE_DEEPSPEED = "ZEROSHARD_ACCELERATE_DEEPSPEED"


class AccelerateDeepSpeedError(RuntimeError):
    """The launcher's accelerate config asked for DeepSpeed ZeRO and accelerate did not take it."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def patch_accelerate_state(module) -> None:
    """Give `PartialState` gloo on a CPU-only DeepSpeed launch; check the state it ends with."""
    partial, full = module.PartialState, module.AcceleratorState
    if getattr(partial, "_zeroshard_patched", False):
        return
    prepare_backend, full_init = partial._prepare_backend, full.__init__

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = prepare_backend(self, cpu, sagemaker_dp, backend)
        if (chosen is None and not cpu and not sagemaker_dp and _flag("ACCELERATE_USE_DEEPSPEED")
                and int(os.environ.get("LOCAL_RANK", -1)) != -1):
            return "gloo", kind  # no accelerator: DeepSpeed's ranks talk over gloo
        return chosen, kind

    def __init__(self, *args, **kwargs):
        full_init(self, *args, **kwargs)
        asked = os.environ.get(ACCELERATE_DEEPSPEED)
        kind = str(getattr(self, "distributed_type", ""))
        if asked and _flag("ACCELERATE_USE_DEEPSPEED") and not kind.endswith("DEEPSPEED"):
            why = ("the Accelerator was made with cpu=True (or ACCELERATE_USE_CPU is set), which "
                   "turns DeepSpeed off in accelerate" if getattr(self, "_cpu", False) else
                   "accelerate did not take its DeepSpeed path")
            raise AccelerateDeepSpeedError(
                f"zeroshard run: the accelerate config {asked} says distributed_type: DEEPSPEED, "
                f"but accelerate set up {kind.split('.')[-1]}: {why}. ZeRO would not be engaged. "
                "Drop cpu=True (on a machine without GPUs zeroshard runs ZeRO on CPU ranks over "
                "gloo), or remove the DeepSpeed section from the config to train without ZeRO")

    partial._prepare_backend = _prepare_backend
    full.__init__ = __init__
    partial._zeroshard_patched = True


#: module name -> what to do once it has been imported.
PATCHES = {"accelerate.state": patch_accelerate_state}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        """The wrapped loader's module."""
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        """Run the module, then patch it."""
        self.loader.exec_module(module)
        self.patch(module)


class PatchFinder(importlib.abc.MetaPathFinder):
    """Finds the modules in PATCHES through the other finders and patches them once loaded."""

    def find_spec(self, fullname, path=None, target=None):
        """The real spec with a patching loader, for the modules in PATCHES."""
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Patch the libraries in PATCHES when they are imported (now, if they already are)."""
    if not any(isinstance(f, PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PatchFinder())
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
