"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions over zeroshard checkpoints, and over
DeepSpeed's own (`checkpoint/recovery.py`; `consolidate.py` does the work for zeroshard's: one
tensor in memory at a time when writing safetensors)."""

from __future__ import annotations

import torch

from ....checkpoint.recovery import fp32_state_dict, write_fp32


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict:
    """The whole model's fp32 state dict from a checkpoint written at any stage and world size
    (zeroshard's or DeepSpeed's)."""
    return fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str,
                                               tag: str | None = None, max_shard_size="5GB",
                                               safe_serialization: bool = True,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """Write the checkpoint's fp32 weights under `output_dir`: safetensors, or torch.save's
    `pytorch_model.bin` with `safe_serialization=False` (HF-style shards beyond
    `max_shard_size`); returns the files written."""
    return write_fp32(checkpoint_dir, output_dir, tag, safe_serialization, max_shard_size,
                      exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: str,
                                         tag: str | None = None) -> torch.nn.Module:
    """Load a checkpoint's fp32 weights into a plain (unwrapped) `model`; returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=False)
    return model
