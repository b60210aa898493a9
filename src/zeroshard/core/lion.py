"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the config's
`"type": "Lion"` and the class behind DeepSpeed's `DeepSpeedCPULion` / `FusedLion` names
(compat/deepspeed/ops/lion.py). torch has no Lion; this is the paper's update, elementwise, so
zeroshard shards it like any torch optimizer:

    c = beta1 * m + (1 - beta1) * g;  p -= lr * (sign(c) + weight_decay * p);
    m = beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """The Lion update (module docstring), one exponential moment per parameter."""

    _zeroshard_elementwise = True

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if lr <= 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr > 0, 0 <= betas < 1 and weight_decay >= 0 are needed, "
                             f"got lr={lr}, betas={betas}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One Lion step for every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                update = (m * beta1).add_(p.grad, alpha=1 - beta1).sign_()
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
