"""DeepSpeed's `deepspeed.utils.tensor_fragment` getters: a parameter's whole fp32 master and
optimizer state from the shards (core/fragments.py). Every rank calls them for the same parameter
(they communicate); they return None for a parameter without a master, as DeepSpeed does."""

from ....core import fragments

safe_get_full_fp32_param = fragments.full_master
safe_get_full_optimizer_state = fragments.full_optimizer_state

__all__ = ["safe_get_full_fp32_param", "safe_get_full_optimizer_state"]
