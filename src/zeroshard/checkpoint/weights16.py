"""The model's weights, whole and in the compute dtype, for inference or the Hub: what DeepSpeed
calls the 16-bit model (`engine.save_16bit_model`, `engine._zero3_consolidated_16bit_state_dict`).

Stage 3 gathers them unit by unit (`core/gathered.full_state_dict`: rank 0 holds the result plus
one unit at a time); every rank calls, rank 0 writes. A `.safetensors` name is written as
safetensors with tied weights under each of their names (what `from_pretrained` expects),
anything else with `torch.save`, through a temporary name: never a half-written file under the
final one.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from ..core.gathered import full_state_dict
from ..core.layout import plain_named
from ..dist import Comm


def consolidated_16bit(module: nn.Module, exclude_frozen: bool = False) -> dict:
    """The whole state dict on rank 0 (empty elsewhere), without frozen parameters if asked
    (PEFT adapters). Every rank calls it."""
    state = full_state_dict(module, rank0_only=True)
    if exclude_frozen:
        frozen = {n for n, p in plain_named(module.named_parameters()) if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def save_16bit(module: nn.Module, comm: Comm, save_dir: str, save_filename: str, *,
               stage: int, gather_at_stage3: bool, exclude_frozen: bool = False) -> bool:
    """Rank 0 writes `save_dir/save_filename`; at stage 3 only when `gather_at_stage3`
    (stage3_gather_16bit_weights_on_model_save: False and a warning otherwise, as DeepSpeed).
    Every rank calls it; all return once the file is written."""
    if stage == 3 and not gather_at_stage3:
        warnings.warn("save_16bit_model: nothing saved, because at stage 3 it needs "
                      "zero_optimization.stage3_gather_16bit_weights_on_model_save=true "
                      "(or use engine.consolidated_state_dict())", stacklevel=3)
        return False
    state = consolidated_16bit(module, exclude_frozen)
    if comm.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        if save_filename.endswith(".safetensors"):
            from .safetensors_file import write_safetensors

            write_safetensors(path, [(n, list(t.shape), t.dtype) for n, t in state.items()],
                              state.values())
        else:
            tmp = path + ".partial"
            torch.save(state, tmp)
            os.replace(tmp, path)
    comm.barrier()
    return True
