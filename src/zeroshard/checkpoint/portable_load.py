"""Loading a checkpoint of another layout into a live engine: DeepSpeed's (`load_deepspeed`).

The checkpoint is read as a `Portable` (`portable.py`; DeepSpeed's: `deepspeed_read.py`) on every
rank, which reassembles whole tensors one at a time from the saved partitions. Each rank then
takes from each whole tensor exactly the part its shards own, through the optimizer's
`ShardedState` (`core/state.py`), the same install a zeroshard checkpoint gets, so any world size,
stage and placement loads it; untrained parameters and buffers are copied whole.

All or nothing, as for zeroshard checkpoints: every rank reads and checks the checkpoint (its
files, that it fits this model: names, shapes, param groups) and the ranks exchange their
verdicts before anything is written; if one rank's check failed, every rank raises
CheckpointError naming the file and the rank, and nothing changed.
"""

from __future__ import annotations

import os

import torch

from ..core.keys import MODEL, buffer_key, frozen_key, model_key, name_of, optim_key
from ..core.layout import plain_named
from .names import Parts
from .portable import Portable
from .verify import CheckpointError, agree, strict_mismatch

__all__ = ["load_deepspeed", "install"]


def load_deepspeed(parts: Parts, load_dir: str, tag: str, load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                   strict: bool = True):
    """Load DeepSpeed checkpoint `load_dir/tag` into `parts` (every rank calls it); returns
    `(path, client_state)` with client_state as DeepSpeed's load_checkpoint returns it (the
    model states' keys DeepSpeed does not consume itself, the user's among them)."""
    from .deepspeed_read import DeepSpeedCheckpoint  # noqa: PLC0415

    path = os.path.join(load_dir, tag)
    with_optim = load_optimizer_states and not load_module_only
    ckpt = None
    try:
        ckpt = DeepSpeedCheckpoint(path, group_names=_group_names(parts))
        check(parts, ckpt, with_optim, strict)
        error = None
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement regardless
        error = f"reading DeepSpeed checkpoint {path} failed: {type(err).__name__}: {err}"
    agree(parts.comm, error)
    try:
        install(parts, ckpt, with_optim, not load_module_only, load_lr_scheduler_states)
    except Exception as err:  # an I/O error reading a partition: the checks had passed
        raise CheckpointError(
            f"could not load {path} after checking it ({type(err).__name__}: {err}); master "
            "weights and optimizer state may be partly overwritten: load a checkpoint again "
            "before training") from None
    parts.comm.barrier()
    return path, ckpt.deepspeed_client_state(load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)


def _trained(parts: Parts) -> dict[str, dict]:
    """The loading engine's trained parameters: `{name: {"shape", "group"}}`."""
    return {n: m for n, m in parts.shards.param_meta().items() if m["group"] >= 0}


def _group_names(parts: Parts) -> list[list[str]]:
    """Per optimizer param group, its trained parameters in the module's order."""
    trained = _trained(parts)
    out: list[list[str]] = [[] for _ in range(parts.shards.group_count())]
    for name, _ in plain_named(parts.module.named_parameters()):
        if name in trained:
            out[trained[name]["group"]].append(name)
    return out


def check(parts: Parts, ckpt: Portable, with_optim: bool, strict: bool) -> None:
    """CheckpointError unless `ckpt` fits the engine's `parts`: every trained parameter saved
    with its shape (with optimizer state: in the same param group); with `strict`, nothing on
    one side only."""
    where = ckpt.path
    trained = _trained(parts)
    module = parts.module
    if with_optim:
        count = parts.shards.group_count()
        if ckpt.groups is None:
            why = ckpt.extra.get("no_optimizer_state") or f"{where} holds no optimizer state"
            raise CheckpointError(f"{why}; load_optimizer_states=False loads the weights alone")
        if len(ckpt.groups) != count:
            raise CheckpointError(f"{where}: {len(ckpt.groups)} optimizer param groups in the "
                                  f"checkpoint, {count} here; load_optimizer_states=False loads "
                                  "the weights alone")
    for name, meta in trained.items():
        saved = ckpt.params.get(name)
        shape = saved[0] if saved is not None else ckpt.frozen.get(name)
        if shape is None:
            raise CheckpointError(f"{where}: no saved values for parameter {name} of this model "
                                  "(was it saved from another model?)")
        if list(shape) != list(meta["shape"]):
            raise CheckpointError(f"{where}: parameter {name} has shape {list(shape)} in the "
                                  f"checkpoint but {list(meta['shape'])} in this model")
        if with_optim and saved is None:
            raise CheckpointError(f"{where}: parameter {name} is trained here but was frozen "
                                  "when saved, so it has no optimizer state; "
                                  "load_optimizer_states=False loads the weights alone")
        if with_optim and saved[1] != meta["group"]:
            raise CheckpointError(f"{where}: parameter {name} is in optimizer param group "
                                  f"{saved[1]} in the checkpoint but {meta['group']} here; "
                                  "build the optimizer's param groups as when saving, or pass "
                                  "load_optimizer_states=False")
    if strict:
        names = {n for n, _ in plain_named(module.named_parameters())}
        buffers = {n for n, _ in plain_named(module.named_buffers())}
        extra = sorted((set(ckpt.params) | set(ckpt.frozen)) - names)
        extra += sorted(set(ckpt.buffers) - buffers)
        persistent = set(module.state_dict().keys())
        lacking = sorted(b for b in buffers - set(ckpt.buffers) if b in persistent)
        strict_mismatch(where, extra, lacking)


class _OnDemand(dict):
    """The values `ShardedState.load_state_dict` asks for, each read from the checkpoint when
    asked (one whole tensor at a time); a parameter trained here but saved untrained reads its
    `frozen.<p>` value for `model.<p>`."""

    def __init__(self, ckpt: Portable, keys):
        super().__init__()
        self._ckpt, self._keys = ckpt, set(keys)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        name = name_of(key, MODEL)
        if name is not None and name not in self._ckpt.params:
            key = frozen_key(name)
        return self._ckpt.tensor(key)


def install(parts: Parts, ckpt: Portable, with_optim: bool, with_train: bool,
            load_lr_scheduler_states: bool) -> None:
    """Write `ckpt` (checked by `check`) into the engine's `parts`: masters, parameters,
    optimizer state, untrained parameters and buffers; `with_train`: also counters, loss scaler,
    LR scheduler (a DeepSpeed save has no RNG state)."""
    sharded = parts.shards
    keys = set()
    for name, meta in sharded.param_meta().items():
        trained = meta["group"] >= 0
        if name in ckpt.params or (trained and name in ckpt.frozen):
            keys.add(model_key(name))
            if trained and with_optim:
                keys |= {optim_key(k, name)
                         for k in ckpt.groups[ckpt.params[name][1]]["tensor_keys"]}
        elif name in ckpt.frozen:  # stage 3's untrained units read their whole saved values
            keys.add(frozen_key(name))
    meta = {"type": ckpt.optimizer_type, "groups": ckpt.groups} if with_optim else None
    sharded.prepare_load(keys, meta, optimizer_state=with_optim)
    sharded.state_dict()  # builds the read targets, writing nothing yet
    with torch.no_grad():  # the masters are leaves that require grad; copied into here
        sharded.load_state_dict(_OnDemand(ckpt, keys))
    in_units = {id(p) for _, p in sharded.named_parameters()}
    with torch.no_grad():
        for name, param in plain_named(parts.module.named_parameters()):
            if id(param) in in_units:
                continue
            if name in ckpt.frozen:
                param.copy_(ckpt.tensor(frozen_key(name)))
            elif name in ckpt.params:
                param.copy_(ckpt.tensor(model_key(name)))
        for name, buf in plain_named(parts.module.named_buffers()):
            if name in ckpt.buffers:
                buf.copy_(ckpt.tensor(buffer_key(name)))
    if with_train:
        train = parts.train
        train.load_state_dict({
            "counters": ckpt.counters,
            "scaler": ckpt.scaler if train.scaler.enabled else None,
            "lr_scheduler": ckpt.lr_scheduler if load_lr_scheduler_states else None})

