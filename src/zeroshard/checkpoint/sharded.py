"""Sharded checkpoints that any world size and any stage can load.

Layout of `save_dir/<tag>/` (written into `save_dir/.<tag>.<host>.<pid>.partial/`, renamed into
place when every rank is done; `save_dir/latest` is replaced last, atomically; see `directory.py`
for the directory's lock and the temporary names):

- DCP files (`.metadata`, `__<rank>_0.distcp`): per parameter, the fp32 values (`model.<name>`)
  and each optimizer state tensor (`optim.<key>.<name>`), as 1-D fragments of the flattened
  parameter. Rank r writes the part of each parameter that falls in its shard `[r*S, (r+1)*S)` of
  the parameter's unit, at every stage. DCP records each fragment's offset, so a loader with
  other units, another world size or another stage reads exactly the ranges it owns. Frozen
  parameters and buffers are saved whole (`frozen.<name>`, `buffer.<name>`).
- `zeroshard.json` (rank 0): format version, world size and stage that saved, counters,
  optimizer hyper-parameters and scalar state (e.g. Adam's step) per param group, loss scaler,
  LR scheduler, and the parameter names/shapes.
- `rng-rank<r>.pt` per rank, `client_state.pt` (rank 0): plain tensors, lists and numbers, read
  back with `torch.load(weights_only=True)`; a `client_state` that cannot be read back that way is
  refused when saving.

Loading is all or nothing. Every rank first checks every file its load will read (see
`checkpoint_verify`: sizes, SHA-256 digests recorded at save time, an allow-listed unpickler for
DCP's `.metadata`, `weights_only` reads of the small files, which are read into memory then), and
the ranks exchange their verdicts. Only when every rank's checks passed is anything written:
parameters, optimizer state, counters, LR scheduler, RNG. Otherwise every rank raises
`CheckpointError` naming the file and the rank that found the problem. Checkpoints saved before
digests were recorded load with the size checks alone.

Saving is all or nothing too (`save.py`).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                              TensorProperties)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..core.hostmem import host_region
from ..core.layout import plain_named
from ..core.mics import replica_targets
from .directory import describe_failure
from .run_state import read_rng, set_rng_state
from .verify import CheckpointError, SafeReader, agree, read_meta, torch_load_verified

__all__ = ["CheckpointError", "SafeReader", "load_checkpoint", "quiet_dcp", "resolve_tag",
           "save_checkpoint"]

FORMAT = 1  # "files" and "content_sha256" were added without a bump: older readers ignore them
META = "zeroshard.json"
CLIENT = "client_state.pt"
CONFIG = "config.json"
LATEST = "latest"


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns on every ShardedTensor use (deprecated in favour of DTensor, which cannot express
    our uneven fragments) and when it loads without a process group; neither concerns the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single.*")
        yield


# -- fragments ---------------------------------------------------------------------------------

def _fragments(unit, slot, world: int) -> list[tuple[int, int, int]]:
    """(rank, start, end) of `slot`'s flattened parameter that each rank's shard holds."""
    out = []
    for rank in range(world):
        lo, hi = unit.shard_bounds(rank)
        start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if start < end:
            out.append((rank, start - slot.offset, end - slot.offset))
    return out


def _placement(tensor: torch.Tensor) -> str:
    """Where `tensor` really lives, as ShardedTensor placements name it: "cpu" for host memory
    (offloaded masters and state, swap files mapped into memory), "cuda:k" on the device."""
    if tensor.device.type == "cpu":
        return "cpu"
    return f"{tensor.device.type}:{tensor.device.index or 0}"


def _sharded(unit, slot, world: int, rank: int, shard: torch.Tensor,
             as_rank: int | None = None) -> ShardedTensor:
    """The parameter `slot` as a 1-D ShardedTensor whose local piece views `shard` (fp32).

    Every rank's fragment is described as placed where this rank's is: the ranks share one
    configuration, so their masters and state live in the same kind of memory. `as_rank`: the
    global rank to place this rank's own fragments on when `rank` numbers a MiCS shard group
    (a load target: a replica reads the fragments its shard-group position owns)."""
    metas, local = [], []
    device = _placement(shard)
    lo = unit.shard_bounds(rank)[0]
    for owner, start, end in _fragments(unit, slot, world):
        placed = as_rank if as_rank is not None and owner == rank else owner
        meta = ShardMetadata([start], [end - start], f"rank:{placed}/{device}")
        metas.append(meta)
        if owner == rank:
            begin = slot.offset + start - lo
            local.append(Shard(shard[begin:begin + end - start], meta))
    # ShardedTensor checks that the local pieces match these properties, pinning included
    # (pinned CPU offload: the masters and optimizer state are page-locked).
    spec = ShardedTensorMetadata(metas, torch.Size([slot.numel]),
                                 TensorProperties(dtype=shard.dtype, pin_memory=shard.is_pinned()))
    with quiet_dcp():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, spec)


def _rank_shard(opt, unit, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard-sized slice of an owned (master-shaped) tensor."""
    if opt.policy.shards_optimizer:
        return tensor
    lo, hi = unit.shard_bounds(opt.comm.rank)
    return tensor[lo:hi]


# -- save (save.py) ----------------------------------------------------------------------------

def save_checkpoint(engine, save_dir: str, tag: str | None = None, client_state=None,
                    save_latest: bool = True, exclude_frozen: bool = False) -> str:
    """Write this rank's part of a checkpoint (every rank calls it); returns the tag's path."""
    from .save import save_checkpoint as save

    return save(engine, save_dir, tag, client_state, save_latest, exclude_frozen)


def _sampler(engine):
    """The DistributedSampler of the DataLoader initialize() built, if any."""
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    return sampler if hasattr(sampler, "set_epoch") else None


# -- load --------------------------------------------------------------------------------------

def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The tag to load: `tag`, else the one `latest` names; None when there is nothing."""
    if tag is not None:
        return str(tag)
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return fh.read().strip()


def _find_tag(load_dir: str, tag: str | None) -> str | None:
    """`resolve_tag`, warning (as DeepSpeed logs) when there is nothing to load: a misspelt
    directory would otherwise start training from scratch without a word."""
    found = resolve_tag(load_dir, tag)
    if found is None:
        why = "does not exist" if not os.path.isdir(load_dir) else \
            f"has no '{LATEST}' file (pass tag= to load a checkpoint without one)"
        warnings.warn(f"zeroshard: checkpoint directory {load_dir} {why}; nothing was loaded",
                      stacklevel=5)  # the caller of engine.load_checkpoint
    return found


def load_checkpoint(engine, load_dir: str, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, strict: bool = True):
    """Load a checkpoint saved at any world size and stage; returns `(path, client_state)`.
    `strict`: a parameter or buffer the checkpoint has and the model lacks, or a buffer the model
    has and the checkpoint lacks, is a CheckpointError (frozen parameters left out by
    `exclude_frozen_parameters` keep their values either way).

    All or nothing: each rank verifies the files it will read (`_check`) and every rank learns
    every rank's verdict before anything is written; if any rank's check failed, every rank
    raises CheckpointError and nothing changed. `(None, None)`, with a warning, when `load_dir`
    does not exist or has no `latest` and no tag was given. Checkpoints saved without recorded
    checksums (older zeroshard) load with the size checks only.
    """
    with host_region():  # strict host mode: offloaded state stays apart from device memory
        return _load(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                     load_module_only, strict)


def _load(engine, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
          load_module_only, strict):
    tag = _find_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    opt, comm = engine.optimizer, engine.comm
    with_optim = load_optimizer_states and not load_module_only
    try:
        checked, error = _check(engine, load_dir, tag, with_optim, not load_module_only,
                                strict), None
    except CheckpointError as err:
        checked, error = None, str(err)
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement regardless
        checked, error = None, f"checking {path} failed: {type(err).__name__}: {err}"
    agree(comm, error)
    meta, reader, state, loaded, rng, client_state = checked
    groups = meta["optimizer"]["groups"]
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        # Only an I/O error, or a file replaced since it was verified, gets here.
        if isinstance(err, CheckpointException) and err.failures:
            err = next(iter(err.failures.values()))[0]
        raise CheckpointError(
            f"could not load {path} after verifying it ({describe_failure(path, err, 'read')}); "
            "master weights and optimizer state may be partly overwritten: load a checkpoint "
            "again before training") from None
    with torch.no_grad():
        # Gradients accumulated before the load (or left by a step that failed half-way) and
        # gathered stage-3 units belong to the old state.
        opt.policy.reset()
        for unit, tensors in loaded:
            if unit.group_index < 0:
                _install_frozen(opt, unit, tensors)
                continue
            _install(opt, unit, tensors, groups[unit.group_index] if with_optim else None)
        opt.placement.flush()
        opt.policy.gather_params()
        opt.broken = None  # every master, state and parameter shard was rewritten
    if not load_module_only:
        _restore_engine(engine, meta, rng, load_lr_scheduler_states, with_optim)
    comm.barrier()
    return path, client_state


def _check(engine, load_dir: str, tag: str, with_optim: bool, with_engine: bool,
           strict: bool = True):
    """Verify every file this rank's load reads, changing nothing; CheckpointError if one fails.

    Returns (meta, reader, DCP state dict of read targets, [(unit, targets)], RNG state or None,
    client_state). The targets view the masters and optimizer state (read into in place later);
    the small files are read here, from the bytes that were hashed.
    """
    opt, comm = engine.optimizer, engine.comm
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (tag {tag!r} in {load_dir})")
    meta_path = os.path.join(path, META)
    meta = read_meta(meta_path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')} is not {FORMAT}")
    _check_params(engine, meta, meta_path)
    files = meta.get("files")
    reader = SafeReader(path, files)
    metadata = reader.read_metadata()  # .metadata's digest, allow-list, every file's size
    saved_keys = set(metadata.state_dict_metadata)
    if strict:
        _check_strict(engine, meta, saved_keys, path)
    state, loaded = _targets(engine, meta["optimizer"]["groups"], with_optim)
    absent = sorted(k for k in state if k not in saved_keys)
    if absent:
        raise CheckpointError(f"{path} has no {absent[0]} ({len(absent)} entries missing; "
                              "load_optimizer_states=False loads the weights alone)")
    frozen_state, frozen_loaded = _frozen_targets(engine, saved_keys)
    state.update(frozen_state)
    loaded += frozen_loaded
    in_units = {id(s.param) for u in [*opt.units, *opt.frozen_units] for s in u.slots}
    rest = {}
    for n, p in plain_named(engine.module.named_parameters()):
        if id(p) in in_units:
            continue
        if f"frozen.{n}" in saved_keys or f"model.{n}" not in saved_keys:
            rest[f"frozen.{n}"] = p.detach()
        else:  # saved sharded by a stage-3 engine: the whole parameter reads every fragment
            rest[f"model.{n}"] = p.detach().view(-1)
    rest.update({f"buffer.{n}": b.detach() for n, b in plain_named(engine.module.named_buffers())})
    # Frozen parameters saved with exclude_frozen_parameters keep their current values.
    state.update({k: v for k, v in rest.items() if k in saved_keys})
    # Exactly the byte ranges DCP will read for this rank: DCP's own planner says which.
    planner = DefaultLoadPlanner()
    with quiet_dcp():
        planner.set_up_planner(state, metadata, is_coordinator=False)
        items = planner.create_local_plan().items
    reader.verify_ranges(metadata.storage_data[item.storage_index] for item in items)
    rng = read_rng(path, comm.rank, files) if with_engine else None
    client_state = torch_load_verified(path, CLIENT, files)
    return meta, reader, state, loaded, rng, client_state


def _frozen_targets(engine, saved_keys: set):
    """DCP read targets for stage 3's frozen units, and [(unit, tensors)] for `_install_frozen`.

    Each unit reads into a copy of this rank's shard (what the checkpoint lacks, saved with
    exclude_frozen_parameters, keeps its value): its fragments, where a stage-3 engine saved them
    (`model.<name>`), or the whole parameter where stages 0-2 saved it (`frozen.<name>`; the load
    then holds those parameters whole, one checkpoint's worth at once)."""
    opt, comm = engine.optimizer, engine.comm
    mics = replica_targets(opt)
    read_as = (*mics, comm.rank) if mics else (comm.world_size, comm.rank, None)
    state, loaded = {}, []
    for unit in opt.frozen_units:
        shard, wholes = None, []
        for slot in unit.slots:
            if f"model.{slot.name}" in saved_keys:
                shard = opt.policy.read_owned(unit).detach().clone() if shard is None else shard
                state[f"model.{slot.name}"] = _sharded(unit, slot, read_as[0], read_as[1], shard,
                                                       read_as[2])
            elif f"frozen.{slot.name}" in saved_keys:
                whole = torch.empty(slot.shape, dtype=unit.dtype, device=unit.compute_device)
                state[f"frozen.{slot.name}"] = whole
                wholes.append((slot, whole))
        if shard is None and wholes:
            shard = opt.policy.read_owned(unit).detach().clone()
        if shard is not None:
            loaded.append((unit, {"model": shard, "wholes": wholes}))
    return state, loaded


def _install_frozen(opt, unit, tensors: dict) -> None:
    """Write a frozen unit's loaded shard (whole parameters cut to this rank's part first)."""
    shard = tensors["model"]
    lo, hi = unit.shard_bounds(opt.comm.rank)
    for slot, whole in tensors["wholes"]:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end:
            shard[start - lo:end - lo].copy_(
                whole.reshape(-1)[start - slot.offset:end - slot.offset])
    opt.policy.write_owned(unit, shard)


def _targets(engine, groups, with_optim: bool):
    """DCP read targets (1-D ShardedTensors) for this rank's fragments, and [(unit, tensors)].

    At stages 1-3 they are the fp32 master and existing state themselves (read into in place,
    once every rank's checks passed); stage 0 reads its shard aside and all-gathers it in
    _install. Building them writes nothing.
    """
    opt, comm = engine.optimizer, engine.comm
    world, rank = comm.world_size, comm.rank
    # MiCS: every replica reads what its position in the shard group owns (core/mics.py).
    mics = replica_targets(opt)
    read_as = (*mics, rank) if mics else (world, rank, None)
    state, loaded = {}, []
    for unit in opt.units:
        master, current = opt.placement.tensors(unit)  # mapped onto swap files for NVMe
        in_place = opt.policy.shards_optimizer  # masters and state are this rank's shard itself
        shard = master if in_place else torch.zeros(unit.shard_numel, device=master.device)
        tensors = {"model": shard}
        if with_optim:
            for key in groups[unit.group_index]["tensor_keys"]:
                existing = current.get(key)
                tensors[key] = existing if in_place and torch.is_tensor(existing) and \
                    existing.shape == shard.shape else torch.zeros_like(shard)
        for slot in unit.slots:
            for key, target in tensors.items():
                name = f"model.{slot.name}" if key == "model" else f"optim.{key}.{slot.name}"
                state[name] = _sharded(unit, slot, read_as[0], read_as[1], target, read_as[2])
        loaded.append((unit, tensors))
    return state, loaded




def _check_strict(engine, meta, saved_keys: set, path: str) -> None:
    """load_module_strict: what the checkpoint holds and the model lacks, and the model's buffers
    the checkpoint lacks, are errors naming them (DeepSpeed's load_state_dict(strict=True))."""
    names = {n for n, _ in plain_named(engine.module.named_parameters())}
    extra = sorted(set(meta["params"]) - names)
    extra += sorted(k.split(".", 1)[1] for k in saved_keys
                    if k.startswith("frozen.") and k.split(".", 1)[1] not in names)
    buffers = {f"buffer.{n}" for n, _ in plain_named(engine.module.named_buffers())}
    saved_buffers = {k for k in saved_keys if k.startswith("buffer.")}
    extra += sorted(k.split(".", 1)[1] for k in saved_buffers - buffers)
    lacking = sorted(k.split(".", 1)[1] for k in buffers - saved_buffers)
    if extra or lacking:
        what = "; ".join(part for part in (
            f"the checkpoint has {extra[:5]} ({len(extra)} in all), which this model lacks"
            if extra else "",
            f"this model has buffers {lacking[:5]} ({len(lacking)} in all) that the checkpoint "
            "lacks" if lacking else "") if part)
        raise CheckpointError(f"{path}: {what}. Nothing was loaded; load_checkpoint(..., "
                              "load_module_strict=False) loads what both have")


def _check_params(engine, meta, meta_path) -> None:
    saved = meta["params"]
    live = {s.name: list(s.shape) for u in engine.optimizer.units for s in u.slots}
    missing = sorted(set(live) - set(saved))
    if missing:
        raise CheckpointError(f"{meta_path}: no saved values for parameters {missing[:5]} of this "
                              "model (was it saved from another model?)")
    wrong = [n for n in live if saved[n]["shape"] != live[n]]
    if wrong:
        n = wrong[0]
        raise CheckpointError(f"{meta_path}: parameter {n} has shape {saved[n]['shape']} in the "
                              f"checkpoint but {live[n]} in this model")


def _full(opt, unit, shard: torch.Tensor) -> torch.Tensor:
    """Owned-sized tensor from this rank's shard: the shard itself, or all-gathered (stage 0)."""
    if opt.policy.shards_optimizer:
        return shard
    full = torch.empty(unit.padded_numel, dtype=shard.dtype, device=shard.device)
    opt.comm.all_gather(full, shard)
    return full


def _install(opt, unit, tensors: dict, group_meta: dict | None) -> None:
    """Put loaded shards into the master, the compute-dtype parameters and the optimizer state."""
    values = _full(opt, unit, tensors["model"])
    opt.policy.write_owned(unit, values)
    if group_meta is None:
        opt.placement.install(unit, values, None)
        return
    fresh = {}
    for key in group_meta["tensor_keys"]:
        fresh[key] = _full(opt, unit, tensors[key]).float()
    for key, info in group_meta["scalars"].items():
        value = info["value"]
        if info["dtype"] is not None:
            fresh[key] = torch.tensor(value, dtype=getattr(torch, info["dtype"].split(".")[-1]),
                                      device=values.device)
        else:
            fresh[key] = value
    # In the optimizer's own key order; no state at all (never stepped) stays absent.
    opt.placement.install(unit, values, {k: fresh[k] for k in group_meta["order"] if k in fresh})


def _restore_engine(engine, meta, rng, load_lr_scheduler_states, with_optim) -> None:
    counters = meta["counters"]
    engine.global_steps = counters["global_steps"]
    engine.global_samples = counters["global_samples"]
    engine.micro_steps = counters["micro_steps"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.optimizer.steps = counters["optimizer_steps"]
    engine.scaler.load_state_dict(meta["scaler"])
    if with_optim:
        for group, saved in zip(engine.optimizer.param_groups, meta["optimizer"]["groups"]):
            for key, value in saved["hyper"].items():
                if key in group:  # betas come back from JSON as a list
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
    if load_lr_scheduler_states and engine.lr_scheduler is not None and \
            meta.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    sampler = _sampler(engine)
    if sampler is not None and meta.get("sampler_epoch") is not None:
        sampler.set_epoch(meta["sampler_epoch"])  # the epoch's shuffle order, as when saved
    if rng is not None:
        set_rng_state(rng)

