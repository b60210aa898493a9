"""Reading a checkpoint's files safely, and proving they are the bytes that were saved.

What `checkpoint.py` writes into `save_dir/<tag>/`, and how each file is checked before a load
changes anything:

- `zeroshard.json` holds `"files"`, a record made at save time: `{name: {"bytes": n, "sha256":
  hex}}` for `.metadata`, every `rng-rank<r>.pt`, `client_state.pt` and `config.json`, and
  `{name: {"bytes": n, "ranges": [[offset, length, sha256 hex], ...]}}` for every
  `__<rank>_<i>.distcp`, one digest per byte range that DCP reads as a unit (one saved fragment
  of one tensor). It also holds `"content_sha256"`, the SHA-256 of its own content in a canonical
  form (sorted keys, no spaces, that key left out), so an edit that still parses is caught too.
- `.metadata` (DCP's pickle) is compared with its digest before it is unpickled, and is then
  unpickled through an allow-list of DCP's own metadata classes (a digest is no protection against
  someone who rewrites `zeroshard.json` as well; the allow-list is).
- Every data file the metadata names must exist, be long enough for the ranges it names and have
  the recorded size (a `stat`, on every rank). Then each rank hashes exactly the ranges its own
  read will fetch (`SafeReader.verify_ranges`), so a load reads the checkpoint once more in all,
  each byte on the rank that reads it next (where it is then in the page cache), and a reader that
  needs part of a checkpoint (the weights alone, consolidation) hashes only that part.
- `rng-rank<r>.pt` and `client_state.pt` are hashed and unpickled (weights only) from the same
  bytes in memory.

The ranks that wrote the files hash them (from the page cache) and send the digests to rank 0,
which records them. Checkpoints saved before checksums existed have neither `"files"` nor
`"content_sha256"`: they still load, with the size checks alone.

A load raises `CheckpointError` on every rank when any rank's checks failed (`agree`), naming the
file and the rank(s) that found the problem.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re

import torch
from torch.distributed.checkpoint import FileSystemReader

CHUNK = 4 * 2**20  # streaming hash read size
SELF_DIGEST = "content_sha256"

# What DCP's .metadata pickle may reference (torch 2.4-2.13); anything else is refused.
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_REFUSED = {"BytesStorageMetadata"}  # non-tensor payloads would be unpickled on load


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, unsafe, or does not fit this model."""


class CheckpointTagError(CheckpointError, AssertionError):
    """The ranks passed different checkpoint tags; also an AssertionError, which is what DeepSpeed
    raises for them under `checkpoint.tag_validation: "fail"`."""


# -- digests -----------------------------------------------------------------------------------

def strict_mismatch(where: str, extra: list[str], lacking: list[str]) -> None:
    """load_module_strict: raise CheckpointError naming what the checkpoint holds and the model
    lacks (`extra`) and the model's buffers the checkpoint lacks (`lacking`); nothing if neither."""
    if not extra and not lacking:
        return
    what = "; ".join(part for part in (
        f"the checkpoint has {extra[:5]} ({len(extra)} in all), which this model lacks"
        if extra else "",
        f"this model has buffers {lacking[:5]} ({len(lacking)} in all) that the checkpoint "
        "lacks" if lacking else "") if part)
    raise CheckpointError(f"{where}: {what}. Nothing was loaded; load_checkpoint(..., "
                          "load_module_strict=False) loads what both have")


def file_digest(path: str) -> dict:
    """`{"bytes": n, "sha256": hex}` of a file, read in 4 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return {"bytes": size, "sha256": digest.hexdigest()}


def range_digests(path: str, ranges) -> list[list]:
    """`[offset, length, sha256 hex]` of each `(offset, length)` range of a file, sorted."""
    out = []
    buffer = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as fh:
        for offset, length in sorted(set(ranges)):
            digest, left = hashlib.sha256(), length
            fh.seek(offset)
            while left:
                n = fh.readinto(memoryview(buffer)[:min(left, CHUNK)])
                if not n:
                    break  # the file is shorter: the digest says so
                digest.update(memoryview(buffer)[:n])
                left -= n
            out.append([offset, length, digest.hexdigest()])
    return out


def owner(name: str, index: int, world: int) -> int:
    """The rank that hashes data file `name` (`index` in the sorted list) after a save: the rank
    that wrote it (DCP names it `__<rank>_<i>.distcp`), where its pages are still cached."""
    match = re.match(r"__(\d+)_", name)
    return (int(match.group(1)) if match else index) % world


def _canonical(meta: dict) -> bytes:
    body = {k: v for k, v in meta.items() if k != SELF_DIGEST}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(meta: dict) -> dict:
    """`meta` as a reader will parse it, with its own content digest added."""
    meta = json.loads(json.dumps(meta))  # tuples -> lists, int keys -> str: what a reader sees
    meta[SELF_DIGEST] = hashlib.sha256(_canonical(meta)).hexdigest()
    return meta


def read_meta(path: str) -> dict:
    """Parse `zeroshard.json` and check its content digest (absent in older checkpoints)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        with open(path, "rb") as fh:
            meta = json.loads(fh.read())
    except ValueError as err:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint file {path} is unreadable (not a JSON object)")
    recorded = meta.get(SELF_DIGEST)
    if recorded is not None and hashlib.sha256(_canonical(meta)).hexdigest() != recorded:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its content differs from the "
                              "digest recorded in it at save time")
    if "files" in meta and recorded is None:
        raise CheckpointError(f"checkpoint file {path} is corrupt: it records file checksums but "
                              "not its own")
    return meta


def _compare(path: str, got: dict, want: dict) -> None:
    if got["bytes"] != want["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: it has {got['bytes']} bytes, "
                              f"{want['bytes']} were recorded at save time")
    if got["sha256"] != want["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: sha256 differs from the one "
                              "recorded at save time")


def _recorded(files: dict | None, rel: str, path: str) -> dict | None:
    if files is None:
        return None
    if rel not in files:
        raise CheckpointError(f"checkpoint file {path} was not recorded at save time (is "
                              "zeroshard.json from another checkpoint?)")
    return files[rel]


def check_file(root, rel: str, files: dict | None) -> None:
    """Hash `root/rel` and compare with its record (nothing to compare in older checkpoints)."""
    path = os.path.join(root, rel)
    want = _recorded(files, rel, path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file missing: {path}")
    if want is not None:
        _compare(path, file_digest(path), want)


def read_verified(root, rel: str, files: dict | None) -> bytes:
    """The bytes of a small file `root/rel`, checked against its record."""
    path = os.path.join(root, rel)
    want = _recorded(files, rel, path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file missing: {path}")
    with open(path, "rb") as fh:
        data = fh.read()
    if want is not None:
        _compare(path, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, want)
    return data


def torch_load_verified(root, rel: str, files: dict | None):
    """A small torch file, checked, then read with `weights_only=True` from the checked bytes."""
    data = read_verified(root, rel, files)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"checkpoint file {os.path.join(root, rel)} is unreadable or unsafe "
                              f"({str(err).splitlines()[0][:300]})") from None


# -- collectives -------------------------------------------------------------------------------

def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def agree(comm, error: str | None, prefix: str = "") -> None:
    """Every rank learns every rank's verdict; all raise CheckpointError if any rank failed."""
    verdicts = comm.all_gather_object(error)
    failed: dict[str, list[int]] = {}
    for rank, message in enumerate(verdicts):
        if message is not None:
            failed.setdefault(message, []).append(rank)
    if failed:
        raise CheckpointError(prefix + "; ".join(f"{_ranks(ranks)}: {message}"
                                                 for message, ranks in failed.items()) +
                              (_ABANDONED if prefix else ""))


#: What a failed save leaves (sharded.py's save undoes everything before it raises).
_ABANDONED = (". The save was abandoned on every rank: nothing of it was kept and 'latest' still "
              "names the previous checkpoint")


def gather_digests(comm, root: str, names: list[str], data: dict[str, list],
                   error: str | None = None, prefix: str = "") -> dict | None:
    """Hash this rank's small files `names` and the `(offset, length)` ranges of its data files
    (`data`); rank 0 gets every rank's `{name: record}`, the others None. A rank that cannot read
    its files, or that brings an `error` of its own (a failed write), makes every rank raise, so
    no rank is left waiting."""
    mine = {}
    if error is None:
        try:
            mine = {name: file_digest(os.path.join(root, name)) for name in names}
            for name, ranges in data.items():
                path = os.path.join(root, name)
                mine[name] = {"bytes": os.path.getsize(path), "ranges": range_digests(path, ranges)}
        except OSError as err:
            mine, error = {}, f"could not hash the files it wrote under {root}: {err}"
    gathered = comm.all_gather_object((mine, error))
    errors = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
    if errors:
        raise CheckpointError(prefix + "; ".join(f"rank {r}: {e}" for r, e in errors) +
                              (_ABANDONED if prefix else ""))
    if comm.rank != 0:
        return None
    return {name: record for part, _ in gathered for name, record in part.items()}


# -- DCP reading -------------------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED_GLOBALS or dtype or \
                (module in _ALLOWED_MODULES and name not in _REFUSED):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to load {module}.{name} from checkpoint metadata: only "
                              "DCP's own metadata classes are allowed (the file may be tampered)")


class SafeReader(FileSystemReader):
    """DCP reader whose metadata is checked against its digest, unpickled with an allow-list,
    and whose data files are checked (sizes at once, contents by `verify_ranges`).

    `files` is `zeroshard.json`'s record of sizes and digests; None for checkpoints saved
    before it existed, which get the size checks alone.
    """

    def __init__(self, path, files: dict | None = None):
        super().__init__(path)
        self.files = files

    def read_metadata(self, *args, **kwargs):
        """Read `.metadata` admitting only DCP metadata classes; check every data file's size."""
        cached = getattr(self, "_checked_metadata", None)
        if cached is not None:  # one reader serves several loads (consolidation)
            return cached
        self._checked_metadata = self._read_checked()
        return self._checked_metadata

    def ranges_of(self, keys) -> list:
        """Every stored range (`_StorageInfo`) of the saved entries `keys`, read whole."""
        keys = set(keys)
        return [info for index, info in self.read_metadata().storage_data.items()
                if index.fqn in keys]

    def verify_ranges(self, ranges) -> None:
        """Hash the stored ranges (`_StorageInfo`s) and compare them with their record."""
        if self.files is None:
            return
        by_file: dict[str, set] = {}
        for info in ranges:
            by_file.setdefault(str(info.relative_path), set()).add((info.offset, info.length))
        for rel, wanted in sorted(by_file.items()):
            file = os.path.join(self.path, rel)
            record = _recorded(self.files, rel, file)
            saved = {(o, n): digest for o, n, digest in record.get("ranges", ())}
            for offset, length, digest in range_digests(file, wanted):
                if (offset, length) not in saved:
                    raise CheckpointError(f"checkpoint file {file} is corrupt: bytes {offset}-"
                                          f"{offset + length} were not recorded at save time")
                if saved[(offset, length)] != digest:
                    raise CheckpointError(f"checkpoint file {file} is corrupt: sha256 of bytes "
                                          f"{offset}-{offset + length} differs from the one "
                                          "recorded at save time")

    def _read_checked(self):
        path = os.path.join(self.path, ".metadata")
        raw = read_verified(self.path, ".metadata", self.files)
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except CheckpointError:
            raise
        except Exception as err:  # truncated or not a pickle at all
            raise CheckpointError(f"checkpoint file {path} is unreadable ({err})") from None
        if type(metadata).__name__ != "Metadata":
            raise CheckpointError(f"{path} does not hold DCP metadata")
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            rel = str(info.relative_path)
            needed[rel] = max(needed.get(rel, 0), info.offset + info.length)
        for rel, size in sorted(needed.items()):
            file = os.path.join(self.path, rel)
            want = _recorded(self.files, rel, file)
            if not os.path.isfile(file):
                raise CheckpointError(f"checkpoint file missing: {file}")
            have = os.path.getsize(file)
            if have < size:
                raise CheckpointError(f"checkpoint file truncated: {file} has "
                                      f"{have} bytes, the metadata needs {size}")
            if want is not None and have != want["bytes"]:
                raise CheckpointError(f"checkpoint file {file} is corrupt: it has {have} bytes, "
                                      f"{want['bytes']} were recorded at save time")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
