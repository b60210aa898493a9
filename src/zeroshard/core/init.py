"""`zeroshard.Init`: build a model already partitioned, so that no rank ever holds all of it.

Inside `with zeroshard.Init(config=...)` (a stage-3 config) every `nn.Module` constructor is
wrapped. A finished module stays whole until the constructor that built it starts building its
next child or returns (parents often write to the child they just built: MultiheadAttention
zeroes its out_proj bias); then each module's direct trainable parameters are laid end to end in
one flat buffer, broadcast from rank 0 (so every rank starts from rank 0's values, as without
Init), and only this rank's 1/N slice is kept. Peak memory during construction is therefore about
two sibling modules plus Psi/N, and the values are exactly those of a normal construction under
the same seed.
`Module.apply` is wrapped too, so a whole-model init pass run from a constructor (Hugging Face's
`post_init`, nanoGPT's `self.apply(_init_weights)`) works on gathered parameters; such a pass
gathers what it walks (the whole model, once, for a pass from the root).

`initialize()` later re-lays these construction-time units into stage-3 units (one module subtree
each), gathering one construction unit at a time. Other code that writes parameters after their
module was built, outside `Module.apply`, must do so inside
`zeroshard.GatheredParameters(params, modifier_rank=0)`, as with DeepSpeed.
`load_full_state_dict` fills a partitioned model from a full state dict, unit by unit, each rank
copying only its slices.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Comm, init_distributed
from ..config.schema import load_config
from .layout import INIT_ATTR, OWNER_ATTR, Slot, Unit, ZeroParamStatus, padded_size, set_status


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


class Init:
    """Construct models partitioned across ranks (stage 3); plain construction at stages 0-2."""

    def __init__(self, config=None, config_dict_or_path=None, enabled: bool = True,
                 remote_device=None, **_ignored):
        source = config if config is not None else config_dict_or_path
        stage = 0
        if enabled and source is not None:
            init_distributed()  # as initialize() would: torchrun's environment, or a world of 1
            stage = load_config(source, world_size=dist.get_world_size()).zero_optimization.stage
        self.enabled = enabled and stage == 3
        self._patched: dict[type, object] = {}
        self._depth: dict[int, int] = {}
        self._building: list[list[nn.Module]] = []  # per constructor running: finished children
        self._versions: dict[int, int] = {}  # id(param) -> its version when partitioned

    def __enter__(self):
        if not self.enabled:
            return self
        self.comm = Comm()
        for cls in [nn.Module, *_subclasses(nn.Module)]:
            self._wrap(cls)
        self._had_init_subclass = "__init_subclass__" in nn.Module.__dict__
        self._original_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        def init_subclass(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            self._wrap(cls)  # classes defined inside the context are wrapped too

        nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._original_apply = nn.Module.apply
        self._applying = False
        init_ctx = self

        def apply(module, fn):
            return init_ctx._apply_gathered(module, fn)

        nn.Module.apply = apply
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        nn.Module.apply = self._original_apply
        if self._had_init_subclass:
            nn.Module.__init_subclass__ = self._original_init_subclass
        else:
            del nn.Module.__init_subclass__
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched.clear()

    def _apply_gathered(self, module: nn.Module, fn):
        """`Module.apply` inside Init: an init pass over built modules (nanoGPT's
        `self.apply(_init_weights)`) sees whole parameters, and what it writes is kept.

        The partitioned parameters under `module` are gathered for the pass (for a pass over the
        whole model that is the whole model, once), then each rank keeps its slice again.
        """
        if self._applying:
            return self._original_apply(module, fn)
        units = gather_init_units(p for p in module.parameters() if hasattr(p, INIT_ATTR))
        self._applying = True
        try:
            self._original_apply(module, fn)
        finally:
            self._applying = False
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
                "Module.apply (Hugging Face's post_init walks the model itself). Build the model "
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

        cls.__init__ = init

    def _flush(self, modules: list[nn.Module]) -> None:
        """Partition the still-whole parameters of these finished modules' subtrees."""
        for module in modules:
            for sub in module.modules():
                self._partition(sub)
        modules.clear()

    def _partition(self, module: nn.Module) -> None:
        """Keep only this rank's slice of each of `module`'s own trainable parameters.

        One construction unit per parameter: rank 0's values are broadcast into the parameter's
        own storage, the slice is copied out, and the storage is dropped - no full-size copy.
        """
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or hasattr(param, INIT_ATTR) or param.numel() == 0:
                continue
            numel = param.numel()
            unit = Unit(-1, -1, param.dtype, [Slot(param, name, 0, numel, param.shape)],
                        self.comm.world_size, numel=numel,
                        padded_numel=padded_size(numel, self.comm.world_size))
            unit.owner = type(module).__name__
            data = param.data.reshape(-1)
            self.comm.broadcast(data, src=0)
            lo, hi = unit.shard_bounds(self.comm.rank)
            unit.shard = torch.zeros(hi - lo, dtype=param.dtype, device=param.device)
            kept = max(0, min(hi, numel) - lo)
            unit.shard[:kept].copy_(data[lo:lo + kept])
            unit.release()
            setattr(param, INIT_ATTR, (unit, self.comm))
            self._versions[id(param)] = param._version

def init_units(model: nn.Module) -> list[Unit]:
    """The construction-time units still holding parameters of `model` (each once)."""
    units = {}
    for param in model.parameters():
        owner = getattr(param, INIT_ATTR, None)
        if owner is not None:
            units[id(owner[0])] = owner[0]
    return list(units.values())


def gather_init_units(params) -> list[Unit]:
    """Gather the construction-time units of `params` (in a rank-independent order)."""
    units, seen = [], set()
    for param in params:
        owner = getattr(param, INIT_ATTR, None)
        if owner is not None and id(owner[0]) not in seen:
            seen.add(id(owner[0]))
            units.append(owner)
    for unit, comm in units:
        if not unit.is_gathered:
            comm.all_gather(unit.allocate(), unit.shard)
            set_status(unit, ZeroParamStatus.AVAILABLE)
    return [u for u, _ in units]


def take_full(params) -> None:
    """Give construction-partitioned `params` whole storage again, one construction unit at a time."""
    pending = [p for p in params if hasattr(p, INIT_ATTR)]
    while pending:
        unit = getattr(pending[0], INIT_ATTR)[0]
        mine = [p for p in pending if getattr(p, INIT_ATTR)[0] is unit]
        gather_init_units(mine)
        wanted = {id(p) for p in mine}
        for slot, view in unit.views(unit.flat):
            if id(slot.param) in wanted:
                slot.param.data = view.clone()
                delattr(slot.param, INIT_ATTR)
        # The parameters that left keep their copies; the rest stay partitioned.
        unit.slots = [s for s in unit.slots if id(s.param) not in wanted]
        unit.release()
        pending = [p for p in pending if id(p) not in wanted]


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into a model trained by zeroshard at any stage.

    Each rank copies only the slices it owns, one unit at a time, and fp32 master weights are
    refreshed; no unit is ever gathered. Missing or unexpected keys raise an error naming them.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise KeyError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys "
                       f"{unexpected[:8]}; nothing was loaded")
    for name, param in model.named_parameters():
        if tuple(state_dict[name].shape) != tuple(getattr(param, "ds_shape", param.shape)):
            raise ValueError(f"load_full_state_dict: {name} has shape "
                             f"{tuple(state_dict[name].shape)} in the state dict but "
                             f"{tuple(param.shape)} in the model; nothing was loaded")
    done = set()
    for param in model.parameters():
        engine_owner = getattr(param, OWNER_ATTR, None)
        init_owner = getattr(param, INIT_ATTR, None)
        if engine_owner is None and init_owner is None:
            param.data.copy_(state_dict[names[id(param)]])
            continue
        optimizer, unit = engine_owner if engine_owner is not None else (None, init_owner[0])
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
