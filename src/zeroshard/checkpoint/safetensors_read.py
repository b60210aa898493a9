"""Reading slices of tensors from safetensors files without loading whole tensors.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's
dtype, shape and `[begin, end)` byte range relative to the end of the header, then the raw
bytes. So the elements `[start, end)` of a tensor (row-major order, the order of a flat view) are
bytes `data_start + begin + start * itemsize` to `... + end * itemsize`: one `pread` reads
exactly them, into host memory of that size. A checkpoint directory holds one
`model.safetensors` or several shards named by `model.safetensors.index.json`'s `weight_map`.
Parsing the header here needs neither the `safetensors` package nor NumPy.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..dist.hostmem import byte_view, host_empty
from .safetensors_file import ST_DTYPES

TORCH_DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        TORCH_DTYPES[_name] = getattr(torch, _attr)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte range."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    def read(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements `[start, end)` of the flattened tensor, as a 1-D host tensor of its dtype."""
        end = self.numel if end is None else end
        if not 0 <= start <= end <= self.numel:
            raise ValueError(f"{self.path}: elements [{start}, {end}) outside a tensor of "
                             f"{self.numel}")
        item = self.dtype.itemsize
        out = host_empty(((end - start) * item,), torch.uint8)
        if end > start:
            with open(self.path, "rb", buffering=0) as fh:
                view, at, offset = byte_view(out), 0, self.begin + start * item
                while at < len(view):  # pread may return fewer bytes than asked
                    got = os.preadv(fh.fileno(), [view[at:]], offset + at)
                    if got <= 0:
                        raise OSError(f"{self.path}: file ends inside a tensor's bytes")
                    at += got
        return out.view(self.dtype)


def read_header(path: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, by name (the header only is read)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(fh.read(length))
        size = os.fstat(fh.fileno()).st_size
    data_start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in TORCH_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which zeroshard "
                             "cannot read")
        begin, end = info["data_offsets"]
        entry = TensorEntry(path, TORCH_DTYPES[info["dtype"]], tuple(info["shape"]),
                            data_start + begin, data_start + end)
        item = entry.dtype.itemsize
        if end - begin != entry.numel * item or entry.end > size:
            raise ValueError(f"{path}: tensor {name}'s byte range does not match its shape "
                             f"{list(entry.shape)} or lies past the end of the file")
        entries[name] = entry
    return entries


def checkpoint_entries(directory: str) -> dict[str, TensorEntry] | None:
    """Every tensor of a checkpoint directory (single file or sharded with an index), or None
    when it holds no safetensors checkpoint."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
        entries = {}
        for shard in sorted(set(weight_map.values())):
            for name, entry in read_header(os.path.join(directory, shard)).items():
                if weight_map.get(name) == shard:
                    entries[name] = entry
        absent = sorted(set(weight_map) - set(entries))
        if absent:
            raise ValueError(f"{index} names tensors its shards do not hold: {absent[:8]}")
        return entries
    single = os.path.join(directory, SINGLE)
    return read_header(single) if os.path.isfile(single) else None
