"""This rank's part of a sharded checkpoint, as a DCP `Stateful`: `ShardedState`.

What it holds (the format of zeroshard's checkpoints, unchanged since format 1): each parameter
of a unit as a 1-D tensor of its flattened values, `model.<name>` (the fp32 master; stage 3's
frozen units: the compute-dtype parameter), and each optimizer state tensor of the same shape as
`optim.<key>.<name>` (Muon's momentum too, as one fragment covering the whole parameter, written
by the matrix's owner: `core/muon_exchange.py`). Rank r holds and saves the part of each
parameter that falls in its shard `[r*S, (r+1)*S)` of the parameter's unit, at every stage
(stage 0 steps the whole unit and saves its shard's part of it; under MiCS the ranks of the first
shard group save, the replicas hold the same values). DCP records each fragment's offset, so a
loader with other units, another world size or another stage reads exactly the ranges it owns.

The fragments reach DCP as `Fragments`: a 1-D tensor of the parameter's size that holds no
storage of its own, only this rank's `(offset, tensor)` pieces, and implements DCP's chunk
protocol (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`; see
`torch.distributed._checkpointable`), the hooks DTensor implements. Not DTensor itself: its
`Shard` placement cuts a dimension into even chunks over a mesh, while a parameter's fragments
are whatever ranges its place in the unit gives. Not `ShardedTensor`, which wrote the checkpoints
until now: torch deprecated it, it warns on every use, and it must describe every rank's fragment
and device to build the one this rank holds. It has to be a tensor subclass, not any object with
those methods: DCP's planner looks up offsets only in `torch.Tensor` values
(`find_state_dict_object`). DCP writes the same entries as before (keys, chunk offsets and sizes,
dtype and pinning), so checkpoints written through ShardedTensor load bitwise and older zeroshard
reads these.

`checkpoint/` talks to `ShardedState` only: `prepare_save()` / `prepare_load()` (what the next
`state_dict()` covers), its `state_dict()` (the entries to save, or the read targets of a load),
`load_state_dict()` (hands what was read to the optimizer's `install_loaded`), and the metadata of
`named_parameters()`, `param_meta()`, `optimizer_meta()`, `group_count()`, `optimizer_name()` and
`nbytes()`. The engine makes one per run and reuses it for every save and load. Units, owned
bounds, placements and MiCS replicas stay in core.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .keys import flat_key, frozen_key, model_key, optim_key
from .mics import replica_position
from .muon_exchange import MOMENTUM_KEY


class Fragments(torch.Tensor):
    """A 1-D tensor of `numel` elements of which this rank holds `pieces` [(offset, tensor)]: what
    DCP writes from or reads into; it has no values of its own (every torch op is refused)."""

    _pieces: list[tuple[int, torch.Tensor]]

    @staticmethod
    def __new__(cls, numel: int, pieces, dtype: torch.dtype, device: torch.device):
        made = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=dtype, device=device,
                                                   requires_grad=False)
        made._pieces = list(pieces)
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a checkpoint Fragments holds only this rank's pieces; use "
                        ".pieces (a list of (offset, tensor)) to read them")

    def __repr__(self) -> str:
        spans = [(offset, offset + piece.numel()) for offset, piece in self._pieces]
        return f"Fragments(numel={self.shape[0]}, dtype={self.dtype}, pieces={spans})"

    @property
    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's `(offset, tensor)` pieces."""
        return list(self._pieces)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        """DCP save: one shard item per piece."""
        items = []
        for offset, piece in self._pieces:
            at = torch.Size([offset])
            items.append(WriteItem(
                index=MetadataIndex(fqn, at), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=at, sizes=piece.size()),
                    properties=TensorProperties(dtype=piece.dtype, pin_memory=piece.is_pinned()),
                    size=self.size())))
        return items

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """DCP load: the ranges this rank reads."""
        return [ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=piece.size())
                for offset, piece in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """DCP: the piece at `index.offset` (written from, or read into in place)."""
        for offset, piece in self._pieces:
            if index.offset == torch.Size([offset]):
                return piece
        raise ValueError(f"{index.fqn}: this rank holds no piece at offset {index.offset} "
                         f"({self!r})")


def _fragments(unit, slot, lo: int, hi: int, shard: torch.Tensor) -> Fragments:
    """`slot`'s parameter as Fragments whose piece views `shard`, the unit's `[lo, hi)`."""
    start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
    pieces = [(start - slot.offset, shard[start - lo:end - lo])] if start < end else []
    return Fragments(slot.numel, pieces, shard.dtype, shard.device)


class ShardedState:
    """This rank's parameters and optimizer state as DCP entries (`torch.distributed.checkpoint.
    stateful.Stateful`): `state_dict()` to save or to read into, `load_state_dict()` to install.

    One per engine, reused: `prepare_save()` or `prepare_load()` says what the next
    `state_dict()` covers (a new one is prepared to save, frozen units included)."""

    def __init__(self, opt):
        self.opt = opt
        self.prepare_save()

    def prepare_save(self, *, frozen: bool = True) -> None:
        """The next `state_dict()` gives the entries to save (`frozen`: of stage 3's frozen
        units too)."""
        self.frozen = frozen
        self.saved_keys = None
        self.groups = None
        self.optimizer_state = True
        self._targets: list | None = None
        #: Muon's momentum read targets by matrix (None: nothing of it is read).
        self._muon_targets: tuple[dict, dict] | None = None

    def prepare_load(self, saved_keys, optimizer_meta=None, *,
                     optimizer_state: bool = True) -> None:
        """The next `state_dict()` gives read targets for a checkpoint holding `saved_keys` (its
        DCP keys), whose `optimizer_meta()` was `optimizer_meta`; `optimizer_state` False: the
        weights alone. Stage 3's frozen units read what the checkpoint has of them."""
        self.prepare_save()
        self.saved_keys = set(saved_keys)
        self.groups = None if optimizer_meta is None else optimizer_meta["groups"]
        self.optimizer_state = optimizer_state

    @property
    def units(self) -> list:
        """The optimizer's trained units."""
        return list(self.opt.units)

    @property
    def frozen_units(self) -> list:
        """Stage 3's units of frozen parameters, if prepared to include them."""
        return list(self.opt.frozen_units) if self.frozen else []

    # -- metadata ------------------------------------------------------------------------------
    def _all_units(self, frozen: bool) -> list:
        return [*self.opt.units, *(self.opt.frozen_units if frozen else ())]

    def named_parameters(self, frozen: bool = True):
        """`(name, parameter)` of every parameter whose shards these entries hold (`frozen`: with
        stage 3's frozen units)."""
        for unit in self._all_units(frozen):
            for slot in unit.slots:
                yield slot.name, slot.param

    def param_meta(self, frozen: bool = True) -> dict[str, dict]:
        """`{name: {"shape", "group"}}` (group: the optimizer param group, -1 for frozen; `frozen`:
        with stage 3's frozen units)."""
        return {slot.name: {"shape": list(slot.shape), "group": unit.group_index}
                for unit in self._all_units(frozen) for slot in unit.slots}

    def group_count(self) -> int:
        """The number of the optimizer's param groups."""
        return len(self.opt.param_groups)

    def optimizer_name(self) -> str:
        """The class name of the user's optimizer (e.g. "AdamW")."""
        return type(self.opt.optimizer).__name__

    def optimizer_meta(self) -> dict:
        """The optimizer's type, and per param group its hyper-parameters, scalar state (e.g.
        Adam's step) and tensor state keys, JSON-ready."""
        return {"type": self.optimizer_name(), "groups": _group_meta(self.opt)}

    @staticmethod
    def nbytes(entries: dict) -> int:
        """Bytes of this rank's pieces among `entries` (from `state_dict()`: what it writes)."""
        return sum(piece.numel() * piece.element_size()
                   for value in entries.values() if isinstance(value, Fragments)
                   for _, piece in value.pieces)

    # -- state dict ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """To save: this rank's entries, viewing the live masters, state and frozen shards. To
        load (`saved_keys` given): the read targets, built without writing anything."""
        if self.saved_keys is None:
            return self._save_entries()
        if self._targets is None:
            self._targets = self._read_targets()
            if self.optimizer_state and self.opt.muon is not None and \
                    any(MOMENTUM_KEY in g.get("whole_keys", ()) for g in self.groups):
                self._muon_targets = self.opt.muon.targets(Fragments)
        out = {k: v for _, _, entries in self._targets for k, v in entries.items()}
        if self._muon_targets is not None:
            out.update(self._muon_targets[0])
        return out

    def _bounds(self, unit) -> tuple[int, int]:
        return unit.shard_bounds(self.opt.comm.rank)

    def _rank_shard(self, unit, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard-sized slice of an owned (master-shaped) tensor."""
        if self.opt.policy.shards_optimizer:
            return tensor
        lo, hi = self._bounds(unit)
        return tensor[lo:hi]

    def _save_entries(self) -> dict[str, torch.Tensor]:
        opt = self.opt
        if replica_position(opt.policy) != 0:
            units, frozen = [], []  # MiCS: the first replica saves what every replica holds
        else:
            units, frozen = self.units, self.frozen_units
        keys = [g["tensor_keys"] for g in self.optimizer_meta()["groups"]] if units else []
        state: dict[str, torch.Tensor] = {}
        for unit in units:
            master, unit_state = opt.placement.tensors(unit)  # mapped onto swap files for NVMe
            lo, hi = self._bounds(unit)
            shard = self._rank_shard(unit, master.detach())
            tensors = {k: self._rank_shard(unit, v) for k, v in unit_state.items()
                       if k in keys[unit.group_index]}
            for slot in unit.slots:
                state[model_key(slot.name)] = _fragments(unit, slot, lo, hi, shard)
                for key, value in tensors.items():
                    state[optim_key(key, slot.name)] = _fragments(unit, slot, lo, hi, value)
        for unit in frozen:
            lo, hi = self._bounds(unit)
            shard = opt.policy.read_owned(unit).detach()
            for slot in unit.slots:
                state[model_key(slot.name)] = _fragments(unit, slot, lo, hi, shard)
        if opt.muon is not None and units:
            state.update(opt.muon.entries(Fragments))
        return state

    def _read_targets(self) -> list:
        """[(unit, {kind: shard-sized tensor}, {DCP key: target})]. Stages 1-3 read into the
        masters and existing state in place; stage 0 reads its shard aside (all-gathered when
        installed); frozen units read into a copy of their shard (keys the checkpoint lacks keep
        their values), or whole parameters a stage 0-2 engine saved as `frozen.<name>`."""
        opt = self.opt
        out = []
        for unit in self.units:
            master, current = opt.placement.tensors(unit)  # mapped onto swap files for NVMe
            in_place = opt.policy.shards_optimizer
            shard = master if in_place else torch.zeros(unit.shard_numel, device=master.device)
            tensors = {"model": shard}
            if self.optimizer_state:
                for key in self.groups[unit.group_index]["tensor_keys"]:
                    existing = current.get(key)
                    tensors[key] = existing if in_place and torch.is_tensor(existing) and \
                        existing.shape == shard.shape else torch.zeros_like(shard)
            lo, hi = self._bounds(unit)
            entries = {}
            for slot in unit.slots:
                for key, target in tensors.items():
                    name = flat_key(key, slot.name)
                    entries[name] = _fragments(unit, slot, lo, hi, target)
            out.append((unit, tensors, entries))
        for unit in self.frozen_units:
            shard, entries, wholes = None, {}, []
            lo, hi = self._bounds(unit)
            for slot in unit.slots:
                if model_key(slot.name) in self.saved_keys:
                    shard = opt.policy.read_owned(unit).detach().clone() if shard is None \
                        else shard
                    entries[model_key(slot.name)] = _fragments(unit, slot, lo, hi, shard)
                elif frozen_key(slot.name) in self.saved_keys:
                    whole = torch.empty(slot.shape, dtype=unit.dtype, device=unit.compute_device)
                    entries[frozen_key(slot.name)] = whole
                    wholes.append((slot, whole))
            if shard is None and wholes:
                shard = opt.policy.read_owned(unit).detach().clone()
            if shard is not None:
                out.append((unit, {"model": shard, "wholes": wholes}, entries))
        return out

    # -- load ----------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """Install what was read into `state_dict()`'s targets (or `state_dict`'s own values for
        them) through the optimizer's `install_loaded`: masters, compute-dtype parameters,
        optimizer state, frozen shards, and (with the optimizer state) Muon's momentum and the
        saved hyper-parameters."""
        if self.saved_keys is None or self._targets is None:
            raise RuntimeError("ShardedState.load_state_dict: call prepare_load() with the "
                               "checkpoint's saved keys and optimizer_meta, and read into its "
                               "state_dict() first")
        muon_entries = self._muon_targets[0] if self._muon_targets is not None else {}
        for entries in [*(e for _, _, e in self._targets), muon_entries]:
            for key, target in entries.items():
                if key not in state_dict:
                    raise KeyError(f"ShardedState.load_state_dict: no {key} in the state dict "
                                   "given; pass the dict its state_dict() returned, read into")
                _take(target, state_dict[key])
        trained = [(unit, tensors) for unit, tensors, _ in self._targets if unit.group_index >= 0]
        frozen = [(unit, tensors) for unit, tensors, _ in self._targets if unit.group_index < 0]
        with torch.no_grad():
            # Generators: stage 0 all-gathers each unit's values as the optimizer installs it.
            self.opt.install_loaded(
                (self._installed(unit, tensors) for unit, tensors in trained),
                ((unit, _frozen_shard(unit, tensors, *self._bounds(unit)))
                 for unit, tensors in frozen),
                optimizer_state=self.optimizer_state,
                muon=None if self._muon_targets is None else self._muon_targets[1],
                hyper=self._hyper() if self.optimizer_state else None)

    def _hyper(self) -> list[dict]:
        """Per live param group, the saved hyper-parameters it has (a tuple saved as a JSON
        list, e.g. betas, made a tuple again)."""
        out = []
        for group, saved in zip(self.opt.param_groups, self.groups):
            out.append({key: tuple(value) if isinstance(group[key], tuple) else value
                        for key, value in saved["hyper"].items() if key in group})
        return out

    def _installed(self, unit, tensors: dict) -> tuple:
        """`(unit, owned values, optimizer state or None)` of a loaded trained unit: the state in
        the optimizer's own key order (none at all, never stepped, stays absent); None when the
        optimizer state is not loaded."""
        values = _full(self.opt, unit, tensors["model"])
        if not self.optimizer_state:
            return unit, values, None
        group_meta = self.groups[unit.group_index]
        fresh = {}
        for key in group_meta["tensor_keys"]:
            fresh[key] = _full(self.opt, unit, tensors[key]).float()
        for key, info in group_meta["scalars"].items():
            value = info["value"]
            if info["dtype"] is not None:
                fresh[key] = torch.tensor(value, device=values.device,
                                          dtype=getattr(torch, info["dtype"].split(".")[-1]))
            else:
                fresh[key] = value
        return unit, values, {k: fresh[k] for k in group_meta["order"] if k in fresh}


def _group_meta(opt) -> list[dict]:
    """Per param group of `opt` (a ZeroOptimizer): its hyper-parameters, scalar state (e.g.
    Adam's step), tensor state keys and state key order, JSON-ready."""
    groups = []
    for group in opt.optimizer.param_groups:
        hyper = {}
        for key, value in group.items():
            if key == "params":
                continue
            try:
                hyper[key] = jsonable(value)
            except TypeError:
                pass  # e.g. a callable: kept from the live optimizer
        scalars, tensor_keys, order = {}, [], []
        for unit in opt.units:
            if opt.param_groups[unit.group_index] is not group:
                continue
            master, unit_state = opt.placement.tensors(unit)
            for key, value in unit_state.items():
                if key not in order:
                    order.append(key)
                if torch.is_tensor(value) and value.shape == master.shape and value.dim() > 0:
                    if key not in tensor_keys:
                        tensor_keys.append(key)
                else:
                    scalars[key] = {"value": jsonable(value), "dtype": str(value.dtype)
                                    if torch.is_tensor(value) else None}
        entry = {"hyper": hyper, "scalars": scalars, "tensor_keys": tensor_keys,
                 "order": order}
        if opt.muon is not None and opt.muon.started and group.get("use_muon"):
            # Muon's momentum: whole matrices saved by their owners (core/muon_exchange.py).
            entry["whole_keys"] = [MOMENTUM_KEY]
        groups.append(entry)
    return groups


def _full(opt, unit, shard: torch.Tensor) -> torch.Tensor:
    """Owned-sized tensor from this rank's shard: the shard itself, or all-gathered (stage 0)."""
    if opt.policy.shards_optimizer:
        return shard
    full = torch.empty(unit.padded_numel, dtype=shard.dtype, device=shard.device)
    opt.comm.all_gather(full, shard)
    return full


def _frozen_shard(unit, tensors: dict, lo: int, hi: int) -> torch.Tensor:
    """A loaded frozen unit's shard `[lo, hi)`, whole parameters read cut to it first."""
    shard = tensors["model"]
    for slot, whole in tensors["wholes"]:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end:
            shard[start - lo:end - lo].copy_(
                whole.reshape(-1)[start - slot.offset:end - slot.offset])
    return shard


def _take(target: torch.Tensor, given) -> None:
    """Copy `given` into `target` unless it is `target` (read in place): Fragments at the same
    offsets, or the whole tensor."""
    if given is target:
        return
    if isinstance(target, Fragments):
        for offset, piece in target.pieces:
            if isinstance(given, Fragments):
                source = given.__get_tensor_shard__(MetadataIndex("", torch.Size([offset])))
            else:
                source = given.reshape(-1)[offset:offset + piece.numel()]
            piece.copy_(source)
    else:
        target.copy_(given)


def jsonable(value):
    """`value` as JSON types (tensors as numbers or lists); TypeError for anything else."""
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    raise TypeError(type(value).__name__)


__all__ = ["Fragments", "ShardedState", "jsonable"]
