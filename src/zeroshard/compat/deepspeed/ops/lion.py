"""Lion under DeepSpeed's names `DeepSpeedCPULion` and `FusedLion` (accelerate swaps the former
in for a bitsandbytes Lion when the optimizer is offloaded); the update itself is core/lion.py's."""

from __future__ import annotations

from ....core.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion", "Lion"]


class DeepSpeedCPULion(Lion):
    """Lion on the CPU (DeepSpeed's signature)."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
                 fp32_optimizer_states=True):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPULion(fp32_optimizer_states=False) is not available: "
                             "zeroshard keeps optimizer state in fp32")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    """Lion on any device (DeepSpeed's FusedLion signature)."""
