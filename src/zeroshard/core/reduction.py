"""How gradients are averaged across ranks: in which dtype, and where the division by N happens.

DeepSpeed's three keys, with DeepSpeed 0.19.8's meaning (engine.allreduce_bucket,
stage_1_and_2.gradient_reduction_w_predivide, stage3.__avg_scatter_grads):

- `communication_data_type` ("fp32" / "fp16" / "bf16"): the dtype the gradients are summed in;
  they are cast to it before the collective. Unset: DeepSpeed sums in the compute dtype; zeroshard
  sums fp16/bf16 gradients in fp32 (a sum of N rounded values in bf16 loses bits at every hop;
  this doubles the bytes sent), and fp32 gradients in fp32.
- `prescale_gradients` true: multiply by 1/N before the sum, nothing after.
- otherwise (post-scaling, the default) with `gradient_predivide_factor` f: multiply by 1/f before
  the sum and by f/N after it (nothing after when f == N). f = 1 is a plain sum then divide by N;
  with fp16 sums, f ~ sqrt(N) keeps both halves of the division in range at large N.
- `gradient_allreduce_op` "sum": a plain sum, no scaling before or after (DeepSpeed then skips
  both keys above); "mean" (the default) averages as described.

The sum then lands in a gradient shard of the accumulation dtype (fp32 unless the masters are
bf16), where micro-steps accumulate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class Reduction:
    """The reduction's dtype and scaling (the config's top-level keys)."""

    dtype: torch.dtype | None = None
    """`communication_data_type`; None: fp32 for fp16/bf16 gradients, their own dtype otherwise."""
    prescale: bool = False
    """`prescale_gradients`: divide by N before the sum instead of after it."""
    predivide: float = 1.0
    """`gradient_predivide_factor`: with post-scaling, divide by it before the sum."""
    average: bool = True
    """`gradient_allreduce_op` "mean"; False ("sum"): the sum is kept, nothing is divided."""

    def comm_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of `grad_dtype` are summed in."""
        if self.dtype is not None:
            return self.dtype
        return torch.float32 if grad_dtype in _LOW else grad_dtype

    def pre_factor(self, world_size: int) -> float:
        """Multiplier applied to the local gradient before the sum (1.0: none)."""
        if not self.average:
            return 1.0
        if self.prescale:
            return 1.0 / world_size if world_size > 1 else 1.0
        return 1.0 / self.predivide if self.predivide != 1.0 else 1.0

    def post_divisor(self, world_size: int) -> float:
        """Divisor applied to the sum (1.0: none): N / f, or 1 under prescaling or summing."""
        if self.prescale or not self.average:
            return 1.0
        return world_size / self.predivide

    def before(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        """Scale `tensor` in place for the sum (no-op when there is nothing to do)."""
        factor = self.pre_factor(world_size)
        return tensor.mul_(factor) if factor != 1.0 else tensor

    def exact_post_factor(self, world_size: int) -> float | None:
        """1 / `post_divisor` when multiplying by it is exactly the division (a power of two: the
        usual world sizes), else None. Multiplying is the cheaper pass, and x * 2^-k scaled before a
        sum equals the sum scaled after it, bit for bit (barring subnormals)."""
        divisor = self.post_divisor(world_size)
        mantissa, _ = math.frexp(divisor)
        return 1.0 / divisor if divisor > 1.0 and mantissa == 0.5 else None

    def after(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        """Turn the sum in `tensor` into the average, in place."""
        divisor = self.post_divisor(world_size)
        if divisor == 1.0:
            return tensor
        factor = self.exact_post_factor(world_size)
        return tensor.mul_(factor) if factor is not None else tensor.div_(divisor)

    def for_reduce(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        """`tensor` in the communication dtype, pre-scaled: a new tensor unless it already is in
        that dtype (then scaled in place)."""
        dtype = self.comm_dtype(tensor.dtype)
        out = tensor if tensor.dtype == dtype else tensor.to(dtype)
        return self.before(out, world_size)


def accumulation_dtype(compute_dtype: torch.dtype, master_dtype: torch.dtype) -> torch.dtype:
    """Where gradient shards accumulate across micro-steps: the masters' dtype (fp32, or bf16
    under bf16_master_weights_and_grads), never below the compute dtype's precision."""
    if compute_dtype in _LOW:
        return master_dtype
    return compute_dtype
