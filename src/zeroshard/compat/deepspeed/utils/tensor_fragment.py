"""DeepSpeed's `deepspeed.utils.tensor_fragment` API: a parameter's fp32 master, optimizer state
and gradient, whole or this rank's piece, read and written in the shards (core/fragments.py for
masters and optimizer state, core/fragment_grads.py for gradients; their docstrings give each
stage's meaning).

Getters return None for a parameter without a master (frozen, or not given to the engine), as
DeepSpeed's do; setters raise ValueError for it, and for a value of the wrong size or an unknown
optimizer-state key. The full getters communicate, and so do the full gradient setters at stages
0-1: every rank calls them for the same parameter. A full setter takes the whole value on every
rank. Unlike DeepSpeed the local functions work at every stage (DeepSpeed asserts stage 3), and a
set fp32 master also sets the compute-dtype parameter, so the next forward uses it."""

from ....core import fragment_grads, fragments

safe_get_full_fp32_param = fragments.full_master
safe_set_full_fp32_param = fragments.set_full_master
safe_get_local_fp32_param = fragments.local_master
safe_set_local_fp32_param = fragments.set_local_master


def safe_get_full_optimizer_state(param, optim_state_key):
    """The whole optimizer state `optim_state_key` of `param` (collective), or None."""
    return fragments.full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param, value, optim_state_key):
    """Set `param`'s optimizer state `optim_state_key` to `value` (the whole tensor, every rank)."""
    fragments.set_full_optimizer_state(param, value, optim_state_key)


def safe_get_local_optimizer_state(param, optim_state_key):
    """This rank's piece of `param`'s optimizer state `optim_state_key`, or None."""
    return fragments.local_optimizer_state(param, optim_state_key)


def safe_set_local_optimizer_state(param, value, optim_state_key):
    """Set this rank's piece of `param`'s optimizer state `optim_state_key` to `value`."""
    fragments.set_local_optimizer_state(param, value, optim_state_key)


safe_get_full_grad = fragment_grads.full_grad
safe_set_full_grad = fragment_grads.set_full_grad
safe_get_local_grad = fragment_grads.local_grad
safe_set_local_grad = fragment_grads.set_local_grad


def safe_update_full_grad_vectorized(param_list, update_func):
    """`update_func(whole gradient, param)` becomes each listed parameter's gradient."""
    fragment_grads.update_full_grads(param_list, update_func)


__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]
