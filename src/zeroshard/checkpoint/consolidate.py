"""`zeroshard consolidate`: a sharded checkpoint -> the whole model as safetensors, one tensor at a time.

No process group and no model are needed. For each entry of the saved model's `state_dict()` (names
as the model has them, tied weights under each of their names, buffers included) DCP reads every
rank's fragments of that tensor into one buffer; the tensor is cast to the requested dtype and
appended to the output file, whose safetensors header was written first from the sizes recorded in
`zeroshard.json`. Tensors are read a few at a time (at most max(2 x the largest, 16 MiB) per
DCP call), so peak memory stays near the largest tensor, not the model.

With `max_shard_bytes`, the output is split Hugging Face style: `model-00001-of-0000N.safetensors`
files plus `model.safetensors.index.json`. A `config.json` saved with the checkpoint (a
transformers model's config) is copied alongside, so `from_pretrained(out_dir)` works.

Before anything is written, every byte it will read is checked against the checksums recorded at
save time (`zeroshard.json`'s own digest, `.metadata`, the byte ranges of the tensors it reads,
`config.json`); a mismatch is a one-line CheckpointError naming the file. Checkpoints saved
before checksums were recorded get the size checks alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import torch
import torch.distributed.checkpoint as dcp

from ..core.keys import MODEL, name_of
from .names import CONFIG, META, quiet_dcp
from .sharded import CheckpointError, SafeReader, resolve_tag
from .verify import check_file, read_meta
from .safetensors_file import tensor_nbytes, write_safetensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB` or a number of bytes -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: expected e.g. 5GB, 500MB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def _open(path: str):
    """A reader of checkpoint `path` and (state_dict name, saved key, shape, saved dtype) for every
    tensor of the saved model, all of it verified first: the bytes read later are the saved ones."""
    meta = read_meta(os.path.join(path, META))
    files = meta.get("files")
    reader = SafeReader(path, files)
    saved = reader.read_metadata().state_dict_metadata  # also checks every data file's size
    out = []
    for name, key in meta["state_dict"].items():
        if key not in saved:
            raise CheckpointError(f"{path}: {key} (for {name}) is not in the checkpoint")
        param = name_of(key, MODEL)
        shape = meta["params"][param]["shape"] if param is not None else list(saved[key].size)
        out.append((name, key, shape, saved[key].properties.dtype))
    reader.verify_ranges(reader.ranges_of(key for _, key, _, _ in out))
    if files is not None and CONFIG in files:
        check_file(path, CONFIG, files)
    return reader, out


def _read_many(reader: SafeReader, entries) -> list[torch.Tensor]:
    """Read the listed (name, key, shape, dtype, ...) entries with one DCP load."""
    buffers = {}
    for _, key, shape, dtype, *_ in entries:
        buffers[key] = torch.empty(math.prod(shape) if name_of(key, MODEL) is not None else shape,
                                   dtype=dtype, device="cpu")  # an offline tool: host memory
    with quiet_dcp():
        dcp.load(buffers, storage_reader=reader, no_dist=True)
    return [buffers[entry[1]].view(entry[2]) for entry in entries]


def _runs(entries, limit: int | None, size_of):
    """Consecutive runs of entries whose sizes add up to at most `limit` (at least one each)."""
    run, size = [], 0
    for entry in entries:
        if limit and run and size + size_of(entry) > limit:
            yield run
            run, size = [], 0
        run.append(entry)
        size += size_of(entry)
    if run:
        yield run


def _read_runs(reader: SafeReader, entries):
    """Yield (entry, tensor) in order, reading a few tensors per DCP call: at most two of the
    largest tensors (and at least 16 MiB), so memory stays near the largest tensor while the
    reads stay few (one call per tensor measured 5x slower)."""
    saved_size = lambda e: tensor_nbytes(e[2], e[3])  # noqa: E731
    budget = max(2 * max(map(saved_size, entries), default=0), 16 * 2**20)
    for run in _runs(entries, budget, saved_size):
        yield from zip(run, _read_many(reader, run))


def consolidated_state_dict(checkpoint_dir: str, tag: str | None = None,
                            dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a zeroshard checkpoint (parameters in `dtype`)."""
    reader, entries = _open(tag_path(checkpoint_dir, tag))
    out = {}
    for (name, *_), tensor in _read_runs(reader, entries):
        out[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() \
            else tensor
    return out


def tag_path(checkpoint_dir: str, tag: str | None) -> str:
    """The directory of checkpoint `tag` (default: the one `latest` names); CheckpointError if absent."""
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file; pass --tag")
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    return path


def consolidate(checkpoint_dir: str, out_dir: str, tag: str | None = None, dtype: str = "fp32",
                max_shard_size: str | int | None = None) -> list[str]:
    """Write the whole model as safetensors under `out_dir`, one tensor in memory at a time."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    path = tag_path(checkpoint_dir, tag)
    reader, saved = _open(path)
    entries = []
    for name, key, shape, saved_dtype in saved:
        out_dtype = target if saved_dtype.is_floating_point else saved_dtype
        entries.append((name, key, shape, saved_dtype, out_dtype, tensor_nbytes(shape, out_dtype)))
    limit = parse_size(max_shard_size) if max_shard_size else None
    shards = list(_runs(entries, limit, lambda e: e[5]))
    os.makedirs(out_dir, exist_ok=True)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(names, shards):
        _write_safetensors(os.path.join(out_dir, file), reader, shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e[5] for e in entries)},
                 "weight_map": {e[0]: file for file, shard in zip(names, shards) for e in shard}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
    config = os.path.join(path, CONFIG)
    if os.path.isfile(config):
        shutil.copy(config, os.path.join(out_dir, "config.json"))
    return [os.path.join(out_dir, n) for n in names]


def _write_safetensors(file: str, reader: SafeReader, entries) -> None:
    """One output file: header from the recorded sizes, then the tensors read a few at a time."""
    specs = [(name, shape, out_dtype) for name, _, shape, _, out_dtype, _ in entries]
    write_safetensors(file, specs, (tensor for _, tensor in _read_runs(reader, entries)))
