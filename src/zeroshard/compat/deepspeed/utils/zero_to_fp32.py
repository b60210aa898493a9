"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions over zeroshard checkpoints, and over
DeepSpeed's own (`checkpoint/recovery.py`; `consolidate.py` does the work for zeroshard's: one
tensor in memory at a time when writing safetensors)."""

from __future__ import annotations

import json
import os

import torch

from ....checkpoint.sharded import META
from ....checkpoint.consolidate import tag_path, consolidated_state_dict


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict:
    """The whole model's fp32 state dict from a checkpoint written at any stage and world size."""
    if not os.path.isfile(os.path.join(tag_path(checkpoint_dir, tag), META)):
        from ....checkpoint.recovery import fp32_state_dict  # a DeepSpeed checkpoint

        return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    state = consolidated_state_dict(checkpoint_dir, tag, torch.float32)
    if exclude_frozen_parameters:
        with open(os.path.join(tag_path(checkpoint_dir, tag), META)) as fh:
            meta = json.load(fh)
        saved_as = meta["state_dict"]  # state-dict name -> key in the checkpoint
        params = meta.get("params", {})

        def frozen(key: str) -> bool:  # saved whole below stage 3; sharded in group -1 at stage 3
            return key.startswith("frozen.") or \
                params.get(key[len("model."):], {}).get("group", 0) < 0

        state = {k: v for k, v in state.items() if not frozen(saved_as.get(k, ""))}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               tag: str | None = None, max_shard_size="5GB",
                                               safe_serialization: bool = True,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the checkpoint's fp32 weights under `output_dir`: safetensors, or torch.save's
    `pytorch_model.bin` with `safe_serialization=False` (HF-style shards beyond
    `max_shard_size`); returns the files written."""
    from ....checkpoint.recovery import write_fp32

    return write_fp32(checkpoint_dir, output_dir, tag, safe_serialization, max_shard_size,
                      exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load a checkpoint's fp32 weights into a plain (unwrapped) `model`; returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=False)
    return model
