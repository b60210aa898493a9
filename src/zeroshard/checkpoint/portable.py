"""A checkpoint as whole per-parameter tensors, whoever wrote it: `Portable`.

zeroshard's own checkpoints are read shard-wise by DCP (`sharded.py`). A checkpoint of another
layout, DeepSpeed's (`deepspeed_read.py`), is instead described by a `Portable`: the parameter
names with their shapes and optimizer param groups, the counters, the LR scheduler, loss scaler
and client state, and `tensor(key)`, which reassembles one whole tensor on demand. Keys are named
as in zeroshard's checkpoints: `model.<p>` (the fp32 master), `optim.<state key>.<p>` (fp32, the
parameter's shape), `frozen.<p>` (an untrained parameter, as saved) and `buffer.<b>`. Whatever
reads a Portable holds one whole tensor at a time, never the model:

- `portable_load.py` installs it into a live engine (any world size, stage, placement);
- `deepspeed_write.py` writes it as a DeepSpeed checkpoint;
- `write_zeroshard()` here writes it as a zeroshard checkpoint (DCP, one process, no model), and
  `ZeroshardCheckpoint` reads a zeroshard checkpoint as a Portable (for `zeroshard convert`).

`groups` has the form zeroshard records in `zeroshard.json` (`ShardedState.optimizer_meta()`):
per param group its `hyper` parameters, `scalars` (e.g. Adam's step, `{"value", "dtype"}`),
per-parameter `tensor_keys` and the state's key `order`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ..core.keys import (BUFFER, FROZEN, MODEL, OPTIM, buffer_key, flat_key, frozen_key, model_key,
                         name_of, named, split_key)
from .names import CLIENT, FORMAT, META, quiet_dcp
from .run_state import check_client_state
from .verify import (CheckpointError, SafeReader, file_digest, range_digests, read_meta, seal,
                     torch_load_verified)

__all__ = ["Portable", "ZeroshardCheckpoint", "write_zeroshard"]


@dataclasses.dataclass
class Portable:
    """What a checkpoint holds, by parameter name; `tensor(key)` reads one whole tensor."""

    path: str
    #: "deepspeed" or "zeroshard": who wrote it.
    source: str
    stage: int
    world_size: int
    #: trained parameter -> (shape, index of its optimizer param group), in the module's order.
    params: dict[str, tuple[tuple[int, ...], int]]
    #: untrained parameter -> shape.
    frozen: dict[str, tuple[int, ...]]
    #: persistent buffer -> shape.
    buffers: dict[str, tuple[int, ...]]
    #: module.state_dict() key -> the entry holding it (tied weights name one entry twice).
    state_dict: dict[str, str]
    #: per optimizer param group: hyper, scalars, tensor_keys, order (None: no optimizer state).
    groups: list[dict] | None
    optimizer_type: str
    #: global_steps, global_samples, skipped_steps (and micro_steps, optimizer_steps if known).
    counters: dict[str, int]
    #: zeroshard's LossScaler.state_dict(); None unless the run was fp16.
    scaler: dict | None
    lr_scheduler: dict | None
    #: the user's client_state (what they passed to save_checkpoint).
    client_state: dict
    #: the dtype the module computed in (None: not recorded).
    dtype: torch.dtype | None = None
    #: format-specific facts (e.g. DeepSpeed's ds_config).
    extra: dict = dataclasses.field(default_factory=dict)

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor of entry `key` (model.<p>, optim.<k>.<p>, frozen.<p>, buffer.<b>)."""
        raise NotImplementedError

    def module_order(self) -> list[str]:
        """Trained parameter names in the module's order, each once."""
        seen = []
        for entry in self.state_dict.values():
            name = name_of(entry, MODEL)
            if name in self.params and name not in seen:
                seen.append(name)
        return seen + [n for n in self.params if n not in seen]

    def group_names(self) -> list[list[str]]:
        """Per optimizer param group, its trained parameters in the module's order."""
        count = len(self.groups) if self.groups is not None else \
            1 + max((g for _, g in self.params.values()), default=-1)
        out: list[list[str]] = [[] for _ in range(count)]
        for name in self.module_order():
            out[self.params[name][1]].append(name)
        return out


# -- zeroshard checkpoints, read and written whole -----------------------------------------------

class ZeroshardCheckpoint(Portable):
    """A zeroshard checkpoint (`<save_dir>/<tag>`) read as a Portable, all of it verified."""

    def __init__(self, path: str):
        meta = read_meta(os.path.join(path, META))
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{os.path.join(path, META)}: format {meta.get('format')} is "
                                  f"not {FORMAT}")
        files = meta.get("files")
        self._reader = SafeReader(path, files)
        saved = self._reader.read_metadata().state_dict_metadata
        self._saved = saved
        params = {n: (tuple(m["shape"]), m["group"]) for n, m in meta["params"].items()}
        frozen = {n: shape for n, (shape, g) in params.items() if g < 0}
        frozen.update({n: tuple(saved[k].size) for n, k in named(saved, FROZEN)})
        counters = dict(meta["counters"])
        super().__init__(
            path=path, source="zeroshard", stage=meta["stage"], world_size=meta["world_size"],
            params={n: v for n, v in params.items() if v[1] >= 0}, frozen=frozen,
            buffers={n: tuple(saved[k].size) for n, k in named(saved, BUFFER)},
            state_dict=dict(meta["state_dict"]), groups=meta["optimizer"]["groups"],
            optimizer_type=meta["optimizer"]["type"], counters=counters,
            scaler=meta.get("scaler"), lr_scheduler=meta.get("lr_scheduler"),
            client_state=torch_load_verified(path, CLIENT, files) or {})
        self._stage3_frozen = {n for n, (_, g) in params.items() if g < 0}

    def tensor(self, key: str) -> torch.Tensor:
        """One entry, read by DCP after its saved bytes were checked against their digests."""
        kind, _, name = split_key(key)
        if kind in (MODEL, OPTIM):
            shape, stored = self.params[name][0], key
        elif kind == FROZEN:
            shape = self.frozen[name]
            stored = model_key(name) if name in self._stage3_frozen else key
        else:
            shape, stored = self.buffers[name], key
        if stored not in self._saved:
            raise CheckpointError(f"{self.path} has no {stored} (a checkpoint saved with "
                                  "exclude_frozen_parameters, or without optimizer state?)")
        properties = self._saved[stored]
        flat = split_key(stored)[0] in (MODEL, OPTIM)
        out = torch.empty(math.prod(shape) if flat else shape, dtype=properties.properties.dtype,
                          device="cpu")
        self._reader.verify_ranges(self._reader.ranges_of([stored]))
        with quiet_dcp():
            dcp.load({stored: out}, storage_reader=self._reader, no_dist=True)
        return out.view(shape)


def write_zeroshard(ckpt: Portable, tag_dir: str, tag: str) -> None:
    """Write `ckpt` as a zeroshard checkpoint into the new directory `tag_dir` (one process):
    whole tensors under zeroshard's keys (any world size reads its ranges of them), and
    `zeroshard.json` with every file's digests."""
    os.makedirs(tag_dir)
    state: dict[str, torch.Tensor] = {}
    groups = ckpt.groups
    for name in ckpt.module_order():
        whats = [MODEL] + (groups[ckpt.params[name][1]]["tensor_keys"] if groups is not None
                           else [])
        for what in whats:
            key = flat_key(what, name)
            state[key] = ckpt.tensor(key).float().reshape(-1)
    for key in map(frozen_key, ckpt.frozen):
        state[key] = ckpt.tensor(key)
    for key in map(buffer_key, ckpt.buffers):
        state[key] = ckpt.tensor(key)
    with quiet_dcp():
        dcp.save(state, storage_writer=FileSystemWriter(tag_dir), no_dist=True)
    try:
        client = check_client_state(ckpt.client_state)
    except ValueError as err:
        raise CheckpointError(f"{ckpt.path}: its client state cannot be stored in a zeroshard "
                              f"checkpoint: {err}") from None
    with open(os.path.join(tag_dir, CLIENT), "wb") as fh:
        fh.write(client)
    files = {name: file_digest(os.path.join(tag_dir, name)) for name in (".metadata", CLIENT)}
    ranges: dict[str, list] = {}
    for info in FileSystemReader(tag_dir).read_metadata().storage_data.values():
        ranges.setdefault(str(info.relative_path), []).append((info.offset, info.length))
    for name, spans in sorted(ranges.items()):
        path = os.path.join(tag_dir, name)
        files[name] = {"bytes": os.path.getsize(path), "ranges": range_digests(path, spans)}
    steps = ckpt.counters["global_steps"]
    gas = int(ckpt.extra.get("gradient_accumulation_steps") or 1)
    from ..core.scaler import LossScaler  # noqa: PLC0415 - the disabled scaler's state

    meta = {
        "format": FORMAT, "tag": tag, "world_size": ckpt.world_size, "stage": ckpt.stage,
        "counters": {"global_steps": steps, "global_samples": ckpt.counters["global_samples"],
                     "micro_steps": ckpt.counters.get("micro_steps", steps * gas),
                     "skipped_steps": ckpt.counters["skipped_steps"],
                     "optimizer_steps": ckpt.counters.get("optimizer_steps", steps)},
        "optimizer": {"type": ckpt.optimizer_type, "groups": groups or []},
        "scaler": ckpt.scaler if ckpt.scaler is not None else LossScaler(False).state_dict(),
        "lr_scheduler": ckpt.lr_scheduler,
        "params": {name: {"shape": list(ckpt.params[name][0]), "group": ckpt.params[name][1]}
                   for name in ckpt.module_order()},
        "state_dict": dict(ckpt.state_dict),
        "sampler_epoch": None,
        "converted_from": {"source": ckpt.source, "path": os.path.abspath(ckpt.path)},
        "files": dict(sorted(files.items())),
    }
    with open(os.path.join(tag_dir, META), "w") as fh:
        fh.write(json.dumps(seal(meta), indent=1))
