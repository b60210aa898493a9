"""DeepSpeed's `deepspeed.accelerator` namespace: `get_accelerator()` (integrations/accelerator.py)."""

from .integrations.accelerator import (CpuAccelerator, CudaAccelerator, DeepSpeedAccelerator,
                                       get_accelerator, is_current_accelerator_supported)

__all__ = ["CpuAccelerator", "CudaAccelerator", "DeepSpeedAccelerator", "get_accelerator",
           "is_current_accelerator_supported"]
