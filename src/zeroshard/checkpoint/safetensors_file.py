"""Writing the safetensors format ourselves: header first, then each tensor's bytes as it comes.

Both `zeroshard consolidate` (tensors streamed from a sharded checkpoint, a few in memory at a
time) and `engine.save_16bit_model` (a gathered state dict) write through `write_safetensors`.
The format is an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the raw bytes. Writing it here needs neither NumPy (which the
`safetensors` package's torch writer imports) nor the whole model in one buffer.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import torch

from ..dist.hostmem import byte_view

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def tensor_nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` and `dtype`."""
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * torch.empty((), dtype=dtype, device="cpu").element_size()


def write_safetensors(path: str, specs: list[tuple[str, list[int], torch.dtype]],
                      tensors: Iterable[torch.Tensor], metadata: dict | None = None) -> None:
    """Write `tensors` (yielded in `specs` order, each cast to its spec's dtype) to `path`.

    `specs` lists `(name, shape, dtype)`; the file appears under `path` only once complete (it is
    written to `path + ".partial"` and renamed), so a crash never leaves a truncated model.
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in specs:
        if dtype not in ST_DTYPES:
            raise ValueError(f"safetensors cannot store {name} of dtype {dtype}")
        nbytes = tensor_nbytes(shape, dtype)
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": [int(s) for s in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = path + ".partial"
    written = 0
    try:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for (name, shape, dtype), tensor in zip(specs, tensors, strict=True):
                tensor = tensor.detach().to("cpu", dtype).contiguous()
                if tensor.numel() * tensor.element_size() != tensor_nbytes(shape, dtype):
                    raise ValueError(f"{name}: got shape {list(tensor.shape)}, header says "
                                     f"{list(shape)}")
                written += fh.write(byte_view(tensor))
        if written != offset:
            raise ValueError(f"{path}: wrote {written} data bytes, the header promises {offset}")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
