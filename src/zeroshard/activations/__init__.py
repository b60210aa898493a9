"""Activation checkpointing as DeepSpeed's `deepspeed.checkpointing` offers it (`checkpointing.py`),
built on `torch.utils.checkpoint` and saved-tensor hooks."""

from . import checkpointing  # noqa: F401
from .checkpointing import checkpoint, configure, is_configured, reset  # noqa: F401

__all__ = ["checkpointing", "checkpoint", "configure", "is_configured", "reset"]
