"""`DeepSpeedCPUAdagrad` under DeepSpeed's name and signature, as torch's Adagrad (accelerate
swaps it in for a torch Adagrad when the optimizer is offloaded to the CPU)."""

from __future__ import annotations

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad on the CPU (DeepSpeed's signature); state stays fp32."""

    _zeroshard_elementwise = True

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
                 fp32_optimizer_states=True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True) is not available (neither in "
                             "DeepSpeed nor in torch's Adagrad)")
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdagrad(fp32_optimizer_states=False) is not available: "
                             "zeroshard keeps optimizer state in fp32")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
