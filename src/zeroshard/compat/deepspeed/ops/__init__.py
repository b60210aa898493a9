"""DeepSpeed's `deepspeed.ops` names, backed by torch's own kernels (`ops.adam`, `ops.adagrad`)
or written here (`ops.lion`)."""

from . import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
