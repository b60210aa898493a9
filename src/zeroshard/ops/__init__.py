"""DeepSpeed's `deepspeed.ops` names, backed by torch's own kernels (`ops.adam`)."""

from . import adam

__all__ = ["adam"]
