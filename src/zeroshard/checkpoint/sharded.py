"""Sharded checkpoints that any world size and any stage can load.

Layout of `save_dir/<tag>/` (written into `save_dir/.<tag>.<host>.<pid>.partial/`, renamed into
place when every rank is done; `save_dir/latest` is replaced last, atomically; see `directory.py`
for the directory's lock and the temporary names):

- DCP files (`.metadata`, `__<rank>_0.distcp`): per parameter, the fp32 values (`model.<name>`)
  and each optimizer state tensor (`optim.<key>.<name>`), as 1-D fragments of the flattened
  parameter: rank r writes the part of each parameter that falls in its shard of the parameter's
  unit, at every stage, and DCP records each fragment's offset, so a loader with other units,
  another world size or another stage reads exactly the ranges it owns. Stage 3's frozen units
  are saved alike, in the compute dtype, under `model.<name>`. These entries come from the
  engine's `ShardedState` (`core/state.py`, a DCP `Stateful`: which fragments, and how they
  reach DCP); this package never looks at units, shards or placements. Other frozen parameters
  and buffers are saved whole (`frozen.<name>`, `buffer.<name>`).
- `zeroshard.json` (rank 0): format version, world size and stage that saved, counters,
  optimizer hyper-parameters and scalar state (e.g. Adam's step) per param group, loss scaler,
  LR scheduler, sampler epoch, and the parameter names/shapes (counters to sampler epoch: the
  engine's `TrainState`, `train_state.py`, a DCP `Stateful` too, whose RNG states go into the
  `rng-rank<r>.pt` files).
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

A `<tag>` directory with DeepSpeed's files (`mp_rank_00_model_states.pt` or stage 3's
`zero_pp_rank_0_mp_rank_00_model_states.pt`) and no `zeroshard.json` is a DeepSpeed checkpoint:
`load_checkpoint` hands it to `portable_load.load_deepspeed`, the one place the two formats meet.
"""

from __future__ import annotations

import os
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..dist.hostmem import host_region
from ..core.keys import BUFFER, FROZEN, buffer_key, frozen_key, model_key, named
from ..core.layout import plain_named
from .directory import describe_failure
from .names import CLIENT, FORMAT, LATEST, META, Parts, quiet_dcp, unknown_format
from .run_state import read_rng
from .verify import (CheckpointError, SafeReader, agree, read_meta, strict_mismatch,
                     torch_load_verified)

__all__ = ["CheckpointError", "SafeReader", "load_checkpoint", "quiet_dcp", "resolve_tag",
           "save_checkpoint"]

# -- save (save.py) ----------------------------------------------------------------------------

def save_checkpoint(parts: Parts, save_dir: str, tag: str | None = None, client_state=None,
                    save_latest: bool = True, exclude_frozen: bool = False) -> str:
    """Write this rank's part of a checkpoint of `parts` (every rank calls it); returns the
    tag's path."""
    from .save import save_checkpoint as save

    return save(parts, save_dir, tag, client_state, save_latest, exclude_frozen)


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


def load_checkpoint(parts: Parts, load_dir: str, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, strict: bool = True):
    """Load a checkpoint saved at any world size and stage into `parts`; returns
    `(path, client_state)`.
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
        return _load(parts, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                     load_module_only, strict)


def _load(parts: Parts, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
          load_module_only, strict):
    tag = _find_tag(load_dir, tag)
    if tag is None:
        return None, None
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, META)):
        from .deepspeed_read import is_deepspeed  # noqa: PLC0415

        if is_deepspeed(path):  # DeepSpeed's files, not zeroshard's: read them whole per tensor
            from .portable_load import load_deepspeed  # noqa: PLC0415

            return load_deepspeed(parts, load_dir, tag, load_optimizer_states,
                                  load_lr_scheduler_states, load_module_only, strict)
    comm = parts.comm
    with_optim = load_optimizer_states and not load_module_only
    try:
        checked, error = _check(parts, load_dir, tag, with_optim, not load_module_only,
                                strict), None
    except CheckpointError as err:
        checked, error = None, str(err)
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement regardless
        checked, error = None, f"checking {path} failed: {type(err).__name__}: {err}"
    agree(comm, error)
    meta, reader, state, sharded, rng, client_state = checked
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
    # Masters, parameters, optimizer state and hyper-parameters; the stage's parameters whole again.
    sharded.load_state_dict(state)
    if not load_module_only:  # counters, loss scaler, LR scheduler, sampler epoch and RNG
        parts.train.load_state_dict({
            "counters": meta["counters"], "scaler": meta["scaler"],
            "lr_scheduler": meta.get("lr_scheduler") if load_lr_scheduler_states else None,
            "sampler_epoch": meta.get("sampler_epoch"), "rng": rng})
    comm.barrier()
    return path, client_state


def _check(parts: Parts, load_dir: str, tag: str, with_optim: bool, with_train: bool,
           strict: bool = True):
    """Verify every file this rank's load reads, changing nothing; CheckpointError if one fails.

    Returns (meta, reader, DCP state dict of read targets, the engine's ShardedState, prepared
    to install them, RNG state or None, client_state). The targets may view the masters and
    optimizer state (read into in place later); the small files are read here, from the bytes
    that were hashed.
    """
    comm, module, sharded = parts.comm, parts.module, parts.shards
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist (tag {tag!r} in {load_dir})")
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"checkpoint file missing: {meta_path}; {unknown_format(path)}")
    meta = read_meta(meta_path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')} is not {FORMAT}")
    _check_params(sharded, meta, meta_path)
    if with_optim:
        _check_groups(sharded, meta["optimizer"], meta_path)
    files = meta.get("files")
    reader = SafeReader(path, files)
    metadata = reader.read_metadata()  # .metadata's digest, allow-list, every file's size
    saved_keys = set(metadata.state_dict_metadata)
    sharded.prepare_load(saved_keys, meta["optimizer"], optimizer_state=with_optim)
    if strict:
        _check_strict(module, meta, saved_keys, path)
    state = sharded.state_dict()
    absent = sorted(k for k in state if k not in saved_keys)
    if absent:
        raise CheckpointError(f"{path} has no {absent[0]} ({len(absent)} entries missing; "
                              "load_optimizer_states=False loads the weights alone)")
    in_units = {id(p) for _, p in sharded.named_parameters()}
    rest = {}
    for n, p in plain_named(module.named_parameters()):
        if id(p) in in_units:
            continue
        if frozen_key(n) in saved_keys or model_key(n) not in saved_keys:
            rest[frozen_key(n)] = p.detach()
        else:  # saved sharded by a stage-3 engine: the whole parameter reads every fragment
            rest[model_key(n)] = p.detach().view(-1)
    rest.update({buffer_key(n): b.detach() for n, b in plain_named(module.named_buffers())})
    # Frozen parameters saved with exclude_frozen_parameters keep their current values.
    state.update({k: v for k, v in rest.items() if k in saved_keys})
    # Exactly the byte ranges DCP will read for this rank: DCP's own planner says which.
    planner = DefaultLoadPlanner()
    with quiet_dcp():
        planner.set_up_planner(state, metadata, is_coordinator=False)
        items = planner.create_local_plan().items
    reader.verify_ranges(metadata.storage_data[item.storage_index] for item in items)
    rng = read_rng(path, comm.rank, files) if with_train else None
    client_state = torch_load_verified(path, CLIENT, files)
    return meta, reader, state, sharded, rng, client_state


def _check_strict(module, meta, saved_keys: set, path: str) -> None:
    """load_module_strict: what the checkpoint holds and the model lacks, and the model's buffers
    the checkpoint lacks, are errors naming them (DeepSpeed's load_state_dict(strict=True))."""
    names = {n for n, _ in plain_named(module.named_parameters())}
    extra = sorted(set(meta["params"]) - names)
    extra += sorted(n for n, _ in named(saved_keys, FROZEN) if n not in names)
    buffers = {n for n, _ in plain_named(module.named_buffers())}
    saved_buffers = {n for n, _ in named(saved_keys, BUFFER)}
    extra += sorted(saved_buffers - buffers)
    lacking = sorted(buffers - saved_buffers)
    strict_mismatch(path, extra, lacking)


def _check_params(sharded, meta, meta_path) -> None:
    """Every trained parameter has saved values of its shape; CheckpointError otherwise."""
    saved = meta["params"]
    live = {n: m["shape"] for n, m in sharded.param_meta().items() if m["group"] >= 0}
    missing = sorted(set(live) - set(saved))
    if missing:
        raise CheckpointError(f"{meta_path}: no saved values for parameters {missing[:5]} of this "
                              "model (was it saved from another model?)")
    wrong = [n for n in live if saved[n]["shape"] != live[n]]
    if wrong:
        n = wrong[0]
        raise CheckpointError(f"{meta_path}: parameter {n} has shape {saved[n]['shape']} in the "
                              f"checkpoint but {live[n]} in this model")


def _check_groups(sharded, saved: dict, meta_path) -> None:
    """The saved optimizer state has one entry per live param group; CheckpointError otherwise
    (e.g. a Muon checkpoint, whose matrices and other parameters are two groups, into AdamW)."""
    live = sharded.group_count()
    if len(saved["groups"]) != live:
        raise CheckpointError(
            f"{meta_path}: the checkpoint's optimizer ({saved.get('type')}) has "
            f"{len(saved['groups'])} param group(s), this engine's "
            f"({sharded.optimizer_name()}) {live}, so its state cannot be matched up; "
            "load_checkpoint(..., load_optimizer_states=False) loads the weights alone")

