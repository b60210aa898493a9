"""DeepSpeed's `deepspeed.ops` names, backed by torch's own kernels (`ops.adam`, `ops.adagrad`)
or written here (`ops.lion`); `__compatible_ops__` says which ops those are (`op_builder`)."""

from . import adagrad, adam, lion, op_builder
from .op_builder import COMPATIBLE_OPS as __compatible_ops__  # noqa: N811 (DeepSpeed's name)

__all__ = ["adagrad", "adam", "lion", "op_builder"]
