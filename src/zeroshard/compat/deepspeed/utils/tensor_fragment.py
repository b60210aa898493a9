"""DeepSpeed's `deepspeed.utils.tensor_fragment` getters and setters: a parameter's whole fp32
master, optimizer state and gradient, and this rank's piece of its gradient, from the shards
(core/fragments.py). The full getters communicate (every rank calls them for the same
parameter); they return None for a parameter without a master, as DeepSpeed does."""

from ....core import fragments

safe_get_full_fp32_param = fragments.full_master
safe_get_full_optimizer_state = fragments.full_optimizer_state
safe_get_full_grad = fragments.full_grad
safe_get_local_grad = fragments.local_grad
safe_set_local_grad = fragments.set_local_grad

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_grad", "safe_set_local_grad"]
