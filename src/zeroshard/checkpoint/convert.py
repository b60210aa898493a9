"""`zeroshard convert`: a DeepSpeed checkpoint into a zeroshard one and back, offline, in one
process.

`convert(src, dst, to="deepspeed")` reads zeroshard checkpoint `src/<tag>` (`portable.py`'s
`ZeroshardCheckpoint`, every byte checked against the digests recorded at save time) and writes
DeepSpeed 0.19's files for `world_size` ranks at `stage` in `dtype` (`deepspeed_write.py`);
DeepSpeed's `engine.load_checkpoint(dst)` then resumes from it at that world size, and DeepSpeed's
`zero_to_fp32.py` reads it. `convert(src, dst, from_="deepspeed")` reads DeepSpeed checkpoint
`src/<tag>` (`deepspeed_read.py`) and writes a zeroshard checkpoint, which any world size and
stage loads. Either way `dst` gets `latest`, `<tag>/` and zeroshard's `zero_to_fp32.py`.

Nothing half-written: everything goes into a temporary directory beside `dst`, renamed into
place at the end (removed on any failure). An existing non-empty `dst` is refused before
anything is read.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from .names import LATEST, META, unknown_format
from .recovery_script import write_script
from .verify import CheckpointError

__all__ = ["DTYPES", "convert", "target_from_config"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def target_from_config(ds_config: dict) -> dict:
    """What a DeepSpeed config says about the checkpoint layout it loads: stage, dtype,
    sub_group_size; CheckpointError for layout options this writer does not produce."""
    zero = ds_config.get("zero_optimization") or {}
    out = {}
    if isinstance(zero.get("stage"), int):
        out["stage"] = zero["stage"]
    for key in ("bf16", "fp16"):
        if (ds_config.get(key) or {}).get("enabled") is True:
            out["dtype"] = key
    if isinstance(zero.get("sub_group_size"), (int, float)):
        out["sub_group_size"] = int(zero["sub_group_size"])
    for key in ("round_robin_gradients", "parameter_alignment"):
        if zero.get(key) is True:
            raise CheckpointError(f"the DeepSpeed config sets zero_optimization.{key}, whose "
                                  "parameter layout zeroshard does not write; convert for a "
                                  "config without it")
    return out


def _check_dst(dst: str) -> None:
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise CheckpointError(f"{dst} exists and is not an empty directory; nothing was written "
                              "(choose a new destination)")


def _source(src: str, tag: str | None) -> tuple[str, str]:
    """`(tag, src/tag)`; CheckpointError if there is no such checkpoint."""
    from .consolidate import tag_path  # noqa: PLC0415

    if not os.path.isdir(src):
        raise CheckpointError(f"{src} does not exist or is not a directory")
    path = tag_path(src, tag)
    return os.path.basename(path), path


def convert(src: str, dst: str, *, to: str | None = None, from_: str | None = None,
            tag: str | None = None, world_size: int | None = None, stage: int | None = None,
            dtype: str | None = None, ds_config: str | dict | None = None) -> str:
    """Convert checkpoint `src` (a save_dir; `tag` or the one `latest` names) into `dst`; exactly
    one of `to="deepspeed"` / `from_="deepspeed"`. Returns `dst`."""
    from .deepspeed_read import DeepSpeedCheckpoint, is_deepspeed  # noqa: PLC0415
    from .portable import ZeroshardCheckpoint, write_zeroshard  # noqa: PLC0415

    if (to is None) == (from_ is None) or (to or from_) != "deepspeed":
        raise CheckpointError("give exactly one of --to deepspeed / --from deepspeed")
    src, dst = os.path.normpath(os.fspath(src)), os.path.normpath(os.fspath(dst))
    _check_dst(dst)
    tag, path = _source(src, tag)
    zeroshard, deepspeed = os.path.isfile(os.path.join(path, META)), is_deepspeed(path)
    if from_ is not None and not deepspeed:
        raise CheckpointError(f"{path} is a zeroshard checkpoint, not a DeepSpeed one (--to "
                              "deepspeed converts it)" if zeroshard else unknown_format(path))
    if to is not None and not zeroshard:
        raise CheckpointError(f"{path} is a DeepSpeed checkpoint, not a zeroshard one (--from "
                              "deepspeed converts it)" if deepspeed else unknown_format(path))
    config = _read_config(ds_config)
    if from_ is not None:
        ckpt = DeepSpeedCheckpoint(path)
        if ckpt.groups is None:
            raise CheckpointError(ckpt.extra["no_optimizer_state"] or
                                  f"{path} holds no optimizer state to convert")
        target = None
    else:
        ckpt = ZeroshardCheckpoint(path)
        target = {"stage": ckpt.stage, "dtype": "fp32", "sub_group_size": 10**9,
                  **target_from_config(config)}
        target.update({k: v for k, v in (("stage", stage), ("dtype", dtype)) if v is not None})
        if target["dtype"] not in DTYPES:
            raise CheckpointError(f"--dtype {target['dtype']!r}: choose from {', '.join(DTYPES)}")
        target["world_size"] = world_size if world_size is not None else ckpt.world_size
    parent = os.path.dirname(os.path.abspath(dst))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.convert-{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        if target is None:
            write_zeroshard(ckpt, os.path.join(tmp, tag), tag)
        else:
            from .deepspeed_write import write_deepspeed  # noqa: PLC0415

            write_deepspeed(ckpt, tmp, tag, target["world_size"], target["stage"],
                            DTYPES[target["dtype"]], config, target["sub_group_size"])
        with open(os.path.join(tmp, LATEST), "w") as fh:
            fh.write(tag)
        write_script(tmp)
        _check_dst(dst)  # still free
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _read_config(ds_config) -> dict:
    """A DeepSpeed config given as a dict or a JSON file's path ({} for None)."""
    if ds_config is None or isinstance(ds_config, dict):
        return dict(ds_config or {})
    try:
        with open(ds_config) as fh:
            config = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"--config {ds_config}: cannot read it as JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"--config {ds_config}: not a JSON object")
    return config
