"""`zeroshard.Init`: build a model already partitioned, so that no rank ever holds all of it.

Inside `with zeroshard.Init(config=...)` (a stage-3 config) every `nn.Module` constructor is
wrapped. A finished module stays whole until the constructor that built it starts building its
next child or returns (parents often write to the child they just built: MultiheadAttention
zeroes its out_proj bias); then each of the module's direct trainable parameters is moved to the
compute device (modules are built where the user's code builds them, usually the CPU, so that
the values are exactly those of a normal construction under the same seed), broadcast from rank 0
(every rank starts from rank 0's values, as without Init), and only this rank's 1/N slice is
kept; the whole copy is freed and the host memory handed back. Peak memory during construction is
therefore about two sibling modules plus Psi/N.
`Module.apply` is wrapped too, so an init pass run from a constructor (nanoGPT's
`self.apply(_init_weights)`) works: each call `fn(module)` sees that module's own parameters
gathered, one module at a time (an apply function must not reach into other modules' parameters).

`initialize()` later re-lays these construction-time slices into stage-3 units with one
all-to-all per unit, never gathering them (`materialize.py`). Other code that writes parameters
after their module was built, outside `Module.apply`, must do so inside
`zeroshard.GatheredParameters(params, modifier_rank=0)`, as with DeepSpeed. A model library whose
models run their own init walk (Hugging Face's `post_init`) plugs in through
`register_library_hooks`: compat/hf/init.py runs that walk the same way, on gathered parameters.
`load_full_state_dict` fills a partitioned model from a full state dict, unit by unit, each rank
copying only its slices.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..dist import default_device, init_distributed
from ..dist.comm import computes_in_fp16
from ..config.schema import load_config, read_raw
from ..dist.hostmem import return_freed_memory
from ..dist.world import World
# init_units, take_full and gather_init_units are re-exported (their users import them from here).
from .init_units import (gather_init_units, init_units, partition_parameter,  # noqa: F401
                         take_full)
from .layout import INIT_ATTR, full_shape
from .owners import is_managed, owner_of
from .sanity import check_in_place_writes

# Host memory freed by partitioning, in bytes, after which it is handed back to the OS.
TRIM_BYTES = 4 << 20


class LibraryHooks(Protocol):
    """What Init needs from a model library whose models initialize themselves (compat/hf/init.py
    for transformers): it is found through `register_library_hooks`, so core imports no library."""

    def patch_init(self, init_ctx: "Init") -> Callable[[], None]:
        """Make the library's own weight init run on gathered parameters; returns the undo."""

    def model_built(self, model: nn.Module) -> None:
        """An outermost model was built partitioned (e.g. give it stage-3 methods)."""


#: Functions returning a model library's LibraryHooks once that library is imported, else None.
#: Filled at import by zeroshard/__init__.py (the top layer), never by core itself.
_LIBRARY_HOOKS: list[Callable[[], "LibraryHooks | None"]] = []


def register_library_hooks(find: Callable[[], "LibraryHooks | None"]) -> None:
    """Let Init consult `find()` while models are built: it returns the hooks of a library
    once that library is in use (None before; asked again at each model constructor)."""
    if find not in _LIBRARY_HOOKS:
        _LIBRARY_HOOKS.append(find)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _without_auto(raw: dict) -> dict:
    return {k: _without_auto(v) if isinstance(v, dict) else v for k, v in raw.items()
            if v != "auto"}


def _init_config(source, world_size: int):
    """The config handed to Init, validated. As in DeepSpeed, "auto" values (Hugging Face's
    bucket and batch sizes, resolved only when the engine is built) are left out here; the rest is
    checked, quietly: initialize() reports its notices."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(_without_auto(read_raw(source)), world_size)


def half_dtype() -> torch.dtype:
    """DeepSpeed's parameter dtype for `zero.Init()` without a config or dtype: fp16 where the
    compute device has fp16 kernels, bf16 elsewhere (a CPU without them)."""
    return torch.float16 if computes_in_fp16(default_device()) else torch.bfloat16


class Init:
    """Construct models partitioned across ranks (stage 3); plain construction at stages 0-2.

    As DeepSpeed's `zero.Init`: without a config it partitions (stage 3), and floating-point
    parameters are kept in `dtype`, else the config's precision (fp16 / bf16 / fp32), else
    `half_dtype()`; `module=` partitions an already-built module at once; `enabled=False`, a
    config whose stage is below 3, or a context nested in an active one builds plainly (the outer
    context partitions what is built).
    """

    def __init__(self, config=None, config_dict_or_path=None, enabled: bool = True,
                 remote_device=None, module: nn.Module | None = None,
                 dtype: torch.dtype | None = None, **_ignored):
        if isinstance(config, nn.Module) and module is None:  # DeepSpeed's first positional
            module, config = config, None
        source = config if config is not None else config_dict_or_path
        stage, self.sanity_checks = 3, False
        self.dtype = dtype
        if enabled:
            init_distributed()  # as DeepSpeed's Init: torchrun's environment, or a world of 1
        if enabled and source is not None:
            cfg = _init_config(source, dist.get_world_size())
            stage = cfg.zero_optimization.stage
            self.sanity_checks = cfg.zero_optimization.enable_sanity_checks
            if dtype is None:
                self.dtype = torch.float16 if cfg.fp16.enabled else \
                    torch.bfloat16 if cfg.bf16.enabled else torch.float32
        elif enabled and dtype is None:
            self.dtype = half_dtype()
        if enabled and self.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"zeroshard.Init: dtype {self.dtype} is not one of torch.float16, "
                             "torch.bfloat16, torch.float32 (DeepSpeed's choices)")
        # Nested inside an active Init (a model_init that calls integrations.hf.from_pretrained
        # under ZeroTrainer's Init): the outer context already partitions everything built.
        self.enabled = enabled and stage == 3 and not init_active()
        self._patched: dict[type, object] = {}
        self._depth: dict[int, int] = {}
        self._building: list[list[nn.Module]] = []  # per constructor running: finished children
        self._versions: dict[int, int] = {}  # id(param) -> its version when partitioned
        if self.enabled:
            self.comm = World.current().comm
            self.device = default_device()
            self._freed = 0  # host bytes freed since memory was last handed back
        if module is not None and self.enabled:
            self._flush([module])
            return_freed_memory()
            for find in _LIBRARY_HOOKS:
                hooks = find()
                if hooks is not None:
                    hooks.model_built(module)

    def __enter__(self):
        if not self.enabled:
            return self
        for cls in [nn.Module, *_subclasses(nn.Module)]:
            self._wrap(cls)
        self._had_init_subclass = "__init_subclass__" in nn.Module.__dict__
        self._original_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            self._wrap(cls)  # classes defined inside the context are wrapped too

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._original_apply = nn.Module.apply
        init_ctx = self

        def apply(module, fn):
            return init_ctx._apply_gathered(module, fn)

        apply._zeroshard_init = True  # marks an active Init (init_active)
        nn.Module.apply = apply
        self._libraries: dict[int, tuple[LibraryHooks, Callable[[], None]]] = {}
        self._patch_libraries()
        return self

    def _patch_libraries(self) -> None:
        """Models of some libraries initialize through their own walk, not Module.apply (Hugging
        Face's: compat/hf/init.py): patch it as soon as the library is imported, also when that
        happens inside the context (a model factory that imports transformers lazily)."""
        for i, find in enumerate(_LIBRARY_HOOKS):
            if i not in self._libraries:
                hooks = find()
                if hooks is not None:
                    self._libraries[i] = (hooks, hooks.patch_init(self))

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        for _, undo in self._libraries.values():
            undo()
        nn.Module.apply = self._original_apply
        if self._had_init_subclass:
            nn.Module.__init_subclass__ = self._original_init_subclass
        else:
            del nn.Module.__init_subclass__
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched.clear()

    def _apply_gathered(self, module: nn.Module, fn):
        """`Module.apply` inside Init: children first, then `fn(module)` with the module's own
        partitioned parameters gathered (one module at a time); what it writes is kept."""
        for child in module.children():
            child.apply(fn)
        own = [p for p in module.parameters(recurse=False) if hasattr(p, INIT_ATTR)]
        units = gather_init_units(own)
        try:
            fn(module)
        finally:
            for unit in units:
                unit.shard.copy_(unit.flat[slice(*unit.shard_bounds(self.comm.rank))])
                unit.release()
                for slot in unit.slots:  # these writes were kept
                    self._versions[id(slot.param)] = slot.param._version
        return module

    def _check_no_lost_writes(self, model: nn.Module) -> None:
        """Refuse a model whose constructor wrote to parameters after partitioning them."""
        lost = [name for name, p in model.named_parameters()
                if id(p) in self._versions and p._version != self._versions[id(p)]]
        if lost:
            raise RuntimeError(
                f"zeroshard.Init: building {type(model).__name__} wrote to {len(lost)} parameters "
                f"after they were partitioned (e.g. {', '.join(lost[:3])}), so the written values "
                "would be lost. Typically a whole-model init pass that does not go through "
                "Module.apply (Hugging Face's post_init is handled), or an apply "
                "function that writes to other modules' parameters (under Init each call sees its "
                "own module's parameters only). Build the model "
                "without zeroshard.Init - initialize() partitions it afterwards - or wrap those "
                "writes in zeroshard.GatheredParameters(params, modifier_rank=0).")

    def _wrap(self, cls) -> None:
        if "__init__" not in cls.__dict__ or cls in self._patched:
            return
        original = cls.__dict__["__init__"]
        self._patched[cls] = original

        @functools.wraps(original)
        def init(module, *args, **kwargs):
            key = id(module)
            outermost = key not in self._depth  # not a super().__init__ call of the same object
            if outermost:
                self._patch_libraries()
                if self._building:
                    # The parent starts another child: its earlier children are finished.
                    self._flush(self._building[-1])
                self._building.append([])
            self._depth[key] = self._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                self._depth[key] -= 1
                if self._depth[key] == 0:
                    del self._depth[key]
                    pending = self._building.pop()
            if outermost:
                self._flush(pending)
                if self._building:
                    # Kept whole until the parent moves on: a parent's constructor often writes
                    # to the child it just built (MultiheadAttention zeroes out_proj.bias).
                    self._building[-1].append(module)
                else:  # an outermost model is complete
                    self._flush([module])
                    self._check_no_lost_writes(module)
                    for hooks, _ in self._libraries.values():
                        hooks.model_built(module)

        cls.__init__ = init

    def _flush(self, modules: list[nn.Module]) -> None:
        """Partition the still-whole parameters of these finished modules' subtrees."""
        for module in modules:
            for sub in module.modules():
                self._partition(sub)
        modules.clear()
        if self._freed >= TRIM_BYTES:
            return_freed_memory()
            self._freed = 0

    def _partition(self, module: nn.Module) -> None:
        """Keep only this rank's slice of each of `module`'s own trainable parameters."""
        for name, param in module.named_parameters(recurse=False):
            if (not param.requires_grad or hasattr(param, INIT_ATTR) or param.numel() == 0
                    or is_managed(param)):
                # Already partitioned, or an engine's (initialize() called inside the context
                # builds modules of its own around the model).
                continue
            if param.is_meta:
                raise RuntimeError(
                    f"zeroshard.Init: {type(module).__name__}.{name} was built on the meta device "
                    "(transformers' own from_pretrained does that), so it has no values to "
                    "partition. At stage 3 load with zeroshard.integrations.hf.from_pretrained("
                    "path, config=ds_config), which builds under Init and streams the weights.")
            if param.device.type == "cpu":
                self._freed += param.numel() * param.element_size()
            partition_parameter(param, name, type(module).__name__, self.comm, self.device,
                                self.dtype)
            if self.sanity_checks:
                check_in_place_writes([param])
            self._versions[id(param)] = param._version


def init_active() -> bool:
    """Whether a `zeroshard.Init` context is active (it replaces `nn.Module.apply`)."""
    return getattr(nn.Module.apply, "_zeroshard_init", False)


@torch.no_grad()
def _real_shape(param: nn.Parameter) -> torch.Size:
    """`param`'s shape in the whole model, also while a stage-3 engine or Init keeps it sharded."""
    owner = owner_of(param)
    if owner is None:
        return full_shape(param)
    return next(s.shape for s in owner.unit.slots if s.param is param)


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into a model trained by zeroshard at any stage.

    Each rank copies only the slices it owns, one unit at a time, and fp32 master weights are
    refreshed; no unit is ever gathered. Missing or unexpected keys raise an error naming them.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    expected = set(model.state_dict(keep_vars=True).keys())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys "
                       f"{unexpected[:8]}; nothing was loaded")
    for name, param in model.named_parameters():
        shape = _real_shape(param)
        if tuple(state_dict[name].shape) != tuple(shape):
            raise ValueError(f"load_full_state_dict: {name} has shape "
                             f"{tuple(state_dict[name].shape)} in the state dict but "
                             f"{tuple(shape)} in the model; nothing was loaded")
    done = set()
    for param in model.parameters():
        engine_owner = owner_of(param)
        init_owner = getattr(param, INIT_ATTR, None)
        if engine_owner is None and init_owner is None:
            param.data.copy_(state_dict[names[id(param)]])
            continue
        optimizer, unit = engine_owner[:2] if engine_owner is not None else (None, init_owner[0])
        if id(unit) in done:
            continue
        done.add(id(unit))
        if unit.is_gathered:  # whole here (stages 0-2, or gathered now): update every element
            for slot in unit.slots:
                slot.param.data.copy_(state_dict[names[id(slot.param)]])
        if unit.shard is not None:  # partitioned: this rank's slice of each parameter
            rank = (optimizer.comm if optimizer is not None else init_owner[1]).rank
            lo, hi = unit.shard_bounds(rank)
            for slot in unit.slots:
                start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if start < end:
                    source = state_dict[names[id(slot.param)]].reshape(-1)
                    unit.shard[start - lo:end - lo].copy_(
                        source[start - slot.offset:end - slot.offset])
        if optimizer is not None:
            for slot in unit.slots:
                optimizer.refresh_master(unit, slot.param)
    for name, buf in model.named_buffers():
        if name in state_dict:
            buf.copy_(state_dict[name])
