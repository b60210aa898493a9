"""`DeepSpeedCPUAdam` and `FusedAdam` under DeepSpeed's names and signatures, as torch's fused
Adam: the fused CPU kernel measured 0.98-1.01x DeepSpeed's `cpu_adam` op
(bench/bench_cpu_adam.py), and the same fused kernel runs on CUDA in FusedAdam's place.

`adamw_mode` / `adam_w_mode` (default True, as in DeepSpeed) decouples weight decay (AdamW);
False adds it to the gradient (Adam). `bias_correction=False` and
`fp32_optimizer_states=False` have no torch equivalent and are refused rather than changed.
"""

from __future__ import annotations

import torch


def _check(name: str, bias_correction: bool) -> None:
    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not available: torch's Adam always "
                         "corrects the moment bias")


class DeepSpeedCPUAdam(torch.optim.Adam):
    """Adam/AdamW on the CPU with torch's fused kernel (DeepSpeed's signature)."""

    _zeroshard_elementwise = True

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        _check("DeepSpeedCPUAdam", bias_correction)
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam(fp32_optimizer_states=False) is not available: "
                             "zeroshard keeps optimizer state in fp32")
        self.adamw_mode = adamw_mode
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=True, decoupled_weight_decay=adamw_mode)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam signature over torch's fused Adam/AdamW kernel (CPU or CUDA)."""

    _zeroshard_elementwise = True

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        _check("FusedAdam", bias_correction)
        self.adam_w_mode = adam_w_mode
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, fused=True, decoupled_weight_decay=adam_w_mode)
