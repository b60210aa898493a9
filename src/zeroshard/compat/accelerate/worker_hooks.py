"""What `zeroshard run` changes in its workers at interpreter start, and nothing else.

The launcher sets ZEROSHARD_WORKER_HOOKS=1 next to the `import deepspeed` alias; the shim's
`sitecustomize.py` then loads this file before the script runs. It imports neither torch nor
zeroshard, and patches only when the library concerned is imported:

* **accelerate on a CPU-only host.** Launched by torchrun (LOCAL_RANK set) and not told
  `cpu=True`, accelerate's `PartialState` asks for the accelerator's backend; without one it
  picks none and counts one process per worker, so every rank trains alone on all the data (under
  plain torchrun too). transformers' Trainer without `--use_cpu` hits the same path; with
  `--ddp_backend gloo` it gets a group of the right size but no DDP wrapping, so the ranks train
  on their shards without syncing gradients. Here, when accelerate found no accelerator backend
  (or was asked for gloo and found no accelerator):
  - with `ACCELERATE_USE_DEEPSPEED=true` (an accelerate config with `distributed_type:
    DEEPSPEED`, or transformers' `--deepspeed`) the state gets gloo, so accelerate counts the
    real world, DeepSpeed's `init_distributed` (zeroshard's) starts gloo, and the state becomes
    DEEPSPEED;
  - otherwise, with WORLD_SIZE > 1, the state becomes MULTI_CPU over gloo, exactly what
    `Accelerator(cpu=True)` gives: one process group over all workers, num_processes = WORLD_SIZE,
    process_index = RANK, DDP in `prepare`, dataloaders sharded. Rank 0 prints one line saying so.
  With an accelerator present, with `cpu=True` (accelerate already does MULTI_CPU), with another
  backend asked for, or with one worker, accelerate is left alone.
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
    """Whether the environment variable `name` is set to a true value."""
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def _no_accelerator(chosen, kind, no, cpu, sagemaker_dp) -> bool:
    """Whether accelerate, launched by torchrun without cpu=True, found no accelerator."""
    return (chosen in (None, "gloo") and kind == no and not cpu and not sagemaker_dp
            and int(os.environ.get("LOCAL_RANK", -1)) != -1)


_announced = []


def _announce_multi_cpu(world: int) -> None:
    """One line on rank 0, once: accelerate's workers become one MULTI_CPU group."""
    if os.environ.get("RANK", "0") == "0" and not _announced:
        _announced.append(world)
        print(f"zeroshard run: no accelerator on this host; accelerate's {world} workers form one "
              "gloo group (DistributedType.MULTI_CPU, as with Accelerator(cpu=True)) instead of "
              f"{world} separate single-process runs", file=sys.stderr, flush=True)


def patch_accelerate_state(module) -> None:
    """Give `PartialState` gloo on a CPU-only torchrun launch; check the state it ends with."""
    partial, full = module.PartialState, module.AcceleratorState
    if getattr(partial, "_zeroshard_patched", False):
        return
    prepare_backend, full_init = partial._prepare_backend, full.__init__
    no, multi_cpu = module.DistributedType.NO, module.DistributedType.MULTI_CPU

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        chosen, kind = prepare_backend(self, cpu, sagemaker_dp, backend)
        if not _no_accelerator(chosen, kind, no, cpu, sagemaker_dp):
            return chosen, kind
        if _flag("ACCELERATE_USE_DEEPSPEED"):
            return "gloo", kind  # DeepSpeed's ranks talk over gloo; the state becomes DEEPSPEED
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world > 1:
            _announce_multi_cpu(world)
            return "gloo", multi_cpu  # accelerate's own cpu=True path from here on
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
