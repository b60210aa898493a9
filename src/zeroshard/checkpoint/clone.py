"""`clone_tensors_for_torch_save` (DeepSpeed's `deepspeed.checkpoint.utils` name, which accelerate
calls on every state dict it saves): copies that own their memory, so that torch.save writes each
tensor's own bytes and not the whole buffer a view points into (a flat buffer, here)."""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device: torch.device | str = torch.device("cpu")):
    """`item` with every tensor (in dicts, lists and tuples, recursively) cloned onto `device`."""
    if torch.is_tensor(item):
        return item.detach().to(device, copy=True)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item
