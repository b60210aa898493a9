"""Saving a sharded checkpoint (the layout: `sharded.py`'s docstring; the directory's lock and
temporary names: `directory.py`).

Saving is all or nothing too. Every rank's outcome of every file it writes (DCP's data and
metadata, its RNG file; rank 0's client state, config, `zeroshard.json`, `latest`) reaches every
rank before `latest` moves: with the digests, then in one last exchange. A failure on any rank is
a `CheckpointError` on every rank naming the rank, the file and the cause (a full disk says so,
with the bytes free and needed); the partial directory is removed, and the previous checkpoint and
`latest` are left as they were. Small files are serialized in memory and written with plain I/O,
so that a full disk reads as one (torch's own file writer says `unexpected pos`).

After a save succeeded, rank 0 writes `save_dir/zero_to_fp32.py` (`recovery_script.py`), as
DeepSpeed does; failing to write it is a warning, not a failed save.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ..dist.hostmem import host_region
from ..core.keys import buffer_key, frozen_key, model_key
from ..core.layout import plain_named
from ..dist.process_group import step_counts
from ..dist.steps import describe_step_counts
from .directory import (describe_failure, describe_os_error, own_directory, partial_name,
                        release_directory, remove_leftovers, write_file, writer_id)
from .names import CLIENT, CONFIG, FORMAT, LATEST, META, Parts, quiet_dcp, rng_file
from .recovery_script import write_script
from .run_state import check_client_state
from .verify import CheckpointError, CheckpointTagError, _ranks, agree, gather_digests, owner, seal

__all__ = ["save_checkpoint"]


def save_checkpoint(parts: Parts, save_dir: str, tag: str | None = None, client_state=None,
                    save_latest: bool = True, exclude_frozen: bool = False) -> str:
    """Write this rank's part of a checkpoint of `parts` (every rank calls it); returns the
    tag's path."""
    with host_region():  # strict host mode: offloaded state stays apart from device memory
        return _save(parts, save_dir, tag, client_state, save_latest, exclude_frozen)


def _save(parts: Parts, save_dir, tag, client_state, save_latest, exclude_frozen) -> str:
    comm = parts.comm
    if save_dir is None or not os.fspath(save_dir):
        # "" would otherwise normalize to the working directory and write a checkpoint there.
        # Every rank is handed the same argument, so every rank refuses before any collective.
        raise ValueError(f"save_checkpoint: save_dir is {save_dir!r}; name the directory to "
                         "write the checkpoint into (it is created if missing)")
    tag = str(tag if tag is not None else f"global_step{parts.train.global_steps}")
    save_dir = os.path.normpath(os.fspath(save_dir))
    try:
        client_bytes, client_error = check_client_state(client_state if client_state is not None
                                                         else {}), None
    except ValueError as err:
        client_bytes, client_error = b"", str(err)
    tag_error = None if tag and os.sep not in tag and not tag.startswith(".") else \
        f"checkpoint tag {tag!r} must be a plain directory name"
    # Rank 0 owns the directory for this job, clears what dead saves left there, and makes this
    # save's own partial directory, all before the ranks first compare notes.
    writer, setup_error = writer_id(), None
    made_dir = comm.rank == 0 and not os.path.isdir(save_dir)
    if comm.rank == 0 and client_error is None and tag_error is None:
        setup_error = own_directory(save_dir)
        if setup_error is None:
            remove_leftovers(save_dir)
            try:
                os.makedirs(os.path.join(save_dir, partial_name(tag, writer)))
            except OSError as err:
                setup_error = describe_os_error(os.path.join(save_dir, partial_name(tag, writer)),
                                                err, "create")
    try:
        views = _agree_on_target(comm, save_dir, tag, client_error, tag_error, setup_error,
                                 writer)
    except BaseException as err:
        if comm.rank == 0 and client_error is None and tag_error is None and setup_error is None:
            shutil.rmtree(os.path.join(save_dir, partial_name(tag, writer)), ignore_errors=True)
            if made_dir:  # a refused save leaves no directory behind either
                release_directory(save_dir)
                with contextlib.suppress(OSError):
                    os.rmdir(save_dir)
        if isinstance(err, (CheckpointError, ValueError)):
            # Refused on every rank alike: no rank returns before rank 0 has cleaned up.
            comm.barrier()
        raise
    final = os.path.join(save_dir, tag)
    partial = os.path.join(save_dir, partial_name(tag, views[0][5]))  # rank 0's name
    try:
        return _write(parts, save_dir, tag, partial, final, client_bytes, save_latest,
                      exclude_frozen)
    except BaseException:
        if comm.rank == 0:  # every rank is past its writes when an agreed error gets here
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _write(parts: Parts, save_dir, tag, partial, final, client_bytes, save_latest,
           exclude_frozen):
    """Write every file into `partial`, agree, then move it into place and point `latest` at it;
    every failure is one CheckpointError on every rank (module docstring)."""
    comm, module, sharded = parts.comm, parts.module, parts.shards
    world, rank = comm.world_size, comm.rank
    keep_frozen = not exclude_frozen
    # This rank's fragments of the masters and optimizer state (and of stage 3's frozen units,
    # in the compute dtype, under model.<name> alike) come from the engine's ShardedState.
    sharded.prepare_save(frozen=keep_frozen)
    state: dict[str, object] = dict(sharded.state_dict())
    optimizer_meta = sharded.optimizer_meta()
    params = sharded.param_meta(frozen=keep_frozen)
    whole: dict[str, object] = {}
    if keep_frozen:
        in_units = {id(p) for _, p in sharded.named_parameters()}
        whole.update({frozen_key(name): param.detach()
                      for name, param in plain_named(module.named_parameters())
                      if id(param) not in in_units})
    whole.update({buffer_key(name): buf.detach()
                  for name, buf in plain_named(module.named_buffers())})
    state.update(whole)
    needed = sharded.nbytes(state) + (_bytes_of(whole) if rank == 0 else 0)
    try:
        with quiet_dcp():
            saved = dcp.save(state, storage_writer=FileSystemWriter(partial))
    except CheckpointException as err:
        # DCP hands every rank the same exception (a BaseException, with each failed rank's own).
        mine = err.failures.get(dist.get_rank()) if dist.is_initialized() else None
        agree(comm, None if mine is None else describe_failure(partial, mine[0], "write the data of",
                                                       needed), prefix="save_checkpoint: ")
        raise CheckpointError(f"save_checkpoint: writing {partial} failed: "
                              f"{str(err).splitlines()[0][:300]}") from None
    rng_name = rng_file(rank)
    mine, error, data = [rng_name], None, {}
    current = os.path.join(partial, rng_name)
    try:
        # The run's state (counters, scaler, scheduler, sampler epoch; this rank's RNG) as of now.
        train = parts.train.state_dict()
        write_file(current, _serialized(train["rng"]))
        storage = getattr(saved, "storage_data", None)
        if storage is None:  # torch 2.11 returns the metadata without it: read what rank 0 wrote
            current = os.path.join(partial, ".metadata")
            storage = FileSystemReader(partial).read_metadata().storage_data
        written: dict[str, list] = {}
        for info in storage.values():
            written.setdefault(str(info.relative_path), []).append((info.offset, info.length))
        data = {name: ranges for i, (name, ranges) in enumerate(sorted(written.items()))
                if owner(name, i, world) == rank}
        if rank == 0:
            current = os.path.join(partial, CLIENT)
            write_file(current, client_bytes)
            config = getattr(module, "config", None)
            if hasattr(config, "to_json_file"):  # a transformers model: from_pretrained needs it
                current = os.path.join(partial, CONFIG)
                config.to_json_file(current)
                mine.append(CONFIG)
            mine += [".metadata", CLIENT]
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement regardless
        error = describe_failure(current, err, "write", needed)
    # Each rank hashes what it has just written (still in its page cache); rank 0 records all.
    # Every rank's outcome so far travels with the digests: one failure fails the save everywhere.
    files = gather_digests(comm, partial, mine, data, error, prefix="save_checkpoint: ")
    error = None
    if rank == 0:
        meta = {
            "format": FORMAT, "tag": tag, "world_size": world,
            "stage": parts.stage,
            "counters": train["counters"],
            "optimizer": optimizer_meta,
            "scaler": train["scaler"],
            "lr_scheduler": train["lr_scheduler"],
            "params": params,
            "state_dict": _state_dict_map(module, sharded, exclude_frozen),
            "sampler_epoch": train["sampler_epoch"],
            "files": dict(sorted(files.items())),
        }
        error = _finish(save_dir, tag, partial, final,
                        json.dumps(seal(meta), indent=1).encode(), save_latest)
        if error is None:  # as DeepSpeed copies its own; before any rank returns
            write_script(save_dir)
    agree(comm, error, prefix="save_checkpoint: ")  # the outcome, on every rank
    return final


def _finish(save_dir, tag, partial, final, meta: bytes, save_latest: bool) -> str | None:
    """Rank 0: write zeroshard.json and the new `latest` aside, then rename both into place,
    undoing what was done if a step fails; an error text or None. Before the renames nothing
    needs new space; a replaced same-tag checkpoint is kept as `.old` until the end."""
    current = os.path.join(partial, META)
    tmp = os.path.join(save_dir, f".{LATEST}.{writer_id()}.tmp")
    old = os.path.join(save_dir, f".{tag}.{writer_id()}.old")
    moved_old = placed = False
    try:
        write_file(current, meta)
        if save_latest:
            current = tmp
            write_file(tmp, tag.encode())
        current = final
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            moved_old = True
        os.rename(partial, final)
        placed = True
        _fsync_dir(save_dir)  # the rename survives a power loss, not only a crash
        if save_latest:
            current = os.path.join(save_dir, LATEST)
            os.replace(tmp, current)
            _fsync_dir(save_dir)
    except Exception as err:  # noqa: BLE001 - undone below, then reported on every rank
        with contextlib.suppress(OSError):
            if placed:
                os.rename(final, partial)  # removed by the caller with the rest of the save
            if moved_old:
                os.rename(old, final)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return describe_failure(current, err, "write" if current != final else "move the save to")
    shutil.rmtree(old, ignore_errors=True)
    return None


def _serialized(obj) -> bytes:
    """`torch.save` into memory: the file is then written with plain I/O, whose errors carry
    errno (torch's own writer reports a full disk as `unexpected pos 64 vs 0`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _bytes_of(tensors: dict) -> int:
    """Bytes of whole tensors (rank 0 writes those: about what a save needs beyond fragments)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _agree_on_target(comm, save_dir: str, tag: str, client_error: str | None,
                     tag_error: str | None = None, setup_error: str | None = None,
                     writer: str = "") -> list:
    """Before anything is written, every rank learns every rank's save_dir, tag and client_state
    verdict (and rank 0's ownership of the directory); all raise if they differ, so no rank
    leaves a half checkpoint that `latest` would name (DeepSpeed's tutorial uses
    `ckpt_id = loss.item()`, which differs per rank), nor one from ranks at different steps
    (each rank's step counts travel in this exchange).
    Returns every rank's view."""
    views = comm.all_gather_object((save_dir, tag, client_error, tag_error, setup_error, writer,
                                    step_counts()))
    problems, error = [], CheckpointError
    for index, what in ((0, "save_dir"), (1, "tag")):
        by_value: dict[str, list[int]] = {}
        for rank, view in enumerate(views):
            by_value.setdefault(view[index], []).append(rank)
        if len(by_value) > 1:
            error = CheckpointTagError if what == "tag" else error
            problems.append(f"the ranks disagree on the checkpoint {what}: " + "; ".join(
                f"{_ranks(ranks)}: {value!r}" for value, ranks in by_value.items()))
    if problems:
        raise error(
            "save_checkpoint: " + "; ".join(problems) + ". Every rank must pass the same save_dir "
            "and tag (e.g. tag=f'global_step{engine.global_steps}', or tag=None for that default); "
            "nothing was written and 'latest' is unchanged")
    if len({tuple(view[6]) for view in views}) > 1:
        raise CheckpointError(
            "save_checkpoint: " + describe_step_counts([tuple(view[6]) for view in views]) +
            "; nothing was written and 'latest' is unchanged")
    errors = [(rank, view[2] or view[3]) for rank, view in enumerate(views)
              if view[2] is not None or view[3] is not None]
    if errors:
        raise ValueError("; ".join(f"rank {rank}: {error}" for rank, error in errors)
                         if len(views) > 1 else errors[0][1])
    if views[0][4] is not None:
        raise CheckpointError(f"save_checkpoint: rank 0: {views[0][4]}. Nothing was written and "
                              "'latest' is unchanged")
    return views


def _fsync_dir(path: str) -> None:
    """Make the directory's entries (a rename) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _state_dict_map(module, sharded, exclude_frozen: bool) -> dict[str, str]:
    """`module.state_dict()` key -> the saved entry holding it (tied weights share one)."""
    saved_name = {id(p): model_key(name)
                  for name, p in sharded.named_parameters(frozen=not exclude_frozen)}
    # Plain names (`_orig_mod.` dropped): a compiled model's checkpoint loads into a plain one.
    for name, param in plain_named(module.named_parameters()):
        if id(param) not in saved_name and not exclude_frozen:
            saved_name[id(param)] = frozen_key(name)
    for name, buf in plain_named(module.named_buffers()):
        saved_name.setdefault(id(buf), buffer_key(name))
    return {key: saved_name[id(t)]
            for key, t in plain_named(module.state_dict(keep_vars=True).items())
            if id(t) in saved_name}
