"""`zeroshard.ops`: DeepSpeed's `deepspeed.ops` names. An old import path kept working: its
modules re-export `zeroshard.compat.deepspeed.ops`, their home."""

from . import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
