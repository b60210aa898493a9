"""The `zero_to_fp32.py` zeroshard writes beside its checkpoints, and what it runs.

DeepSpeed copies its `zero_to_fp32.py` into every save directory, so that whoever has the
checkpoint can get the whole fp32 model back with
`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]`. zeroshard does
the same: `save_checkpoint` (rank 0, after the save succeeded) and `zeroshard convert` write
`recovery_script.SCRIPT` as `<save_dir>/zero_to_fp32.py`. It takes DeepSpeed's command line and
calls `main()` here, which reads zeroshard checkpoints and DeepSpeed ones alike. It needs
zeroshard installed (DeepSpeed's needs DeepSpeed). A DeepSpeed checkpoint written by `zeroshard
convert --to deepspeed` is also read by DeepSpeed's own `zero_to_fp32.py`.

Output as DeepSpeed's: `pytorch_model.bin` (torch.save), or `model.safetensors` with
`--safe_serialization`; beyond `--max_shard_size` (default 5GB) Hugging Face style shards
`pytorch_model-00001-of-0000N.bin` / `model-00001-of-0000N.safetensors` and their
`*.index.json`. A zeroshard checkpoint written as safetensors streams one tensor at a time
(`consolidate.py`); the other cases hold the state dict in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..core.keys import FROZEN, MODEL, name_of
from .names import META, unknown_format
from .verify import CheckpointError

__all__ = ["fp32_state_dict", "main", "write_fp32"]

def _tag_dir(checkpoint_dir: str, tag: str | None) -> str:
    from .consolidate import tag_path  # noqa: PLC0415

    return tag_path(checkpoint_dir, tag)


def fp32_state_dict(checkpoint_dir: str, tag: str | None = None,
                    exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict (floating tensors in fp32) from a zeroshard or DeepSpeed
    checkpoint; tied names share one tensor."""
    path = _tag_dir(checkpoint_dir, tag)
    if os.path.isfile(os.path.join(path, META)):
        from .consolidate import consolidated_state_dict  # noqa: PLC0415

        state = consolidated_state_dict(checkpoint_dir, tag, torch.float32)
        if exclude_frozen_parameters:
            with open(os.path.join(path, META)) as fh:
                meta = json.load(fh)
            saved_as, params = meta["state_dict"], meta.get("params", {})

            def frozen(key: str) -> bool:  # saved whole below stage 3, in group -1 at stage 3
                return name_of(key, FROZEN) is not None or \
                    params.get(name_of(key, MODEL), {}).get("group", 0) < 0

            state = {k: v for k, v in state.items() if not frozen(saved_as.get(k, ""))}
        return state
    from .deepspeed_read import DeepSpeedCheckpoint, is_deepspeed  # noqa: PLC0415
    if not is_deepspeed(path):
        raise CheckpointError(unknown_format(path))
    ckpt = DeepSpeedCheckpoint(path)
    out, made = {}, {}
    for key, entry in ckpt.state_dict.items():
        if exclude_frozen_parameters and name_of(entry, FROZEN) is not None:
            continue
        if entry not in made:
            value = ckpt.tensor(entry)
            made[entry] = value.float() if value.is_floating_point() else value
        out[key] = made[entry]
    return out


def write_fp32(checkpoint_dir: str, output_dir: str, tag: str | None = None,
               safe_serialization: bool = False, max_shard_size: str | int | None = "5GB",
               exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the checkpoint's fp32 model under `output_dir` as DeepSpeed's zero_to_fp32.py
    does; returns the files written."""
    from .consolidate import consolidate, parse_size  # noqa: PLC0415

    path = _tag_dir(checkpoint_dir, tag)
    zeroshard = os.path.isfile(os.path.join(path, META))
    if safe_serialization and zeroshard and not exclude_frozen_parameters:
        return consolidate(checkpoint_dir, output_dir, tag, "fp32", max_shard_size)
    state = fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    limit = parse_size(max_shard_size) if max_shard_size else None
    shards, size, current = [], 0, {}
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if limit and current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = [f"{stem}.{ext}"] if len(shards) == 1 else \
        [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    os.makedirs(output_dir, exist_ok=True)
    files = []
    for file, shard in zip(names, shards):
        target = os.path.join(output_dir, file)
        if safe_serialization:
            from .safetensors_file import write_safetensors  # noqa: PLC0415

            write_safetensors(target, [(n, list(t.shape), t.dtype) for n, t in shard.items()],
                              iter(shard.values()))
        else:
            torch.save({n: t.contiguous() for n, t in shard.items()}, target)
        files.append(target)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for s in shards for t in s.values())},
                 "weight_map": {n: file for file, s in zip(names, shards) for n in s}}
        with open(os.path.join(output_dir, f"{stem}.{ext}.index.json"), "w") as fh:
            json.dump(index, fh, indent=2)
    return files


def main(argv: list[str] | None = None) -> int:
    """`python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [...]`, DeepSpeed's command line."""
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32.py",
        description="Write the whole fp32 model of a zeroshard or DeepSpeed ZeRO checkpoint.")
    parser.add_argument("checkpoint_dir", help="the save_dir (holds 'latest' and the tag folders)")
    parser.add_argument("output_dir", help="where pytorch_model.bin / model.safetensors go")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="split into Hugging Face style shards of at most this size")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors instead of torch.save's pickle")
    parser.add_argument("-t", "--tag", default=None,
                        help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's")
    args = parser.parse_args(argv)
    try:
        files = write_fp32(args.checkpoint_dir, args.output_dir, args.tag,
                           args.safe_serialization, args.max_shard_size,
                           args.exclude_frozen_parameters)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"zero_to_fp32.py: error: {err}", file=sys.stderr)
        return 1
    for file in files:
        print(file)
    return 0
