"""DeepSpeed's `deepspeed.moe.utils` helpers for building optimizer parameter groups, as scripts
and DeepSpeed's own checkpoint tests call them for every model, MoE or not.

zeroshard has no mixture-of-experts layers, so a model here has no expert parameters (DeepSpeed
marks those with `allreduce = False`): splitting the groups leaves them as they are, each group's
`params` made a list. A parameter marked as an expert's is refused with UnsupportedError naming
it, since zeroshard would average it across data-parallel ranks like any other.
"""

from __future__ import annotations

from .alias import UnsupportedError


def is_moe_param(param) -> bool:
    """Whether `param` is marked as an expert's (DeepSpeed's `allreduce = False`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict) -> bool:
    """Whether an optimizer group is one of DeepSpeed's expert groups (`moe: True`)."""
    return bool(param_group.get("moe", False))


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=None):
    """The groups as a list of dicts (a dict or tuple accepted), `params` lists; expert parameters
    are refused (zeroshard has no mixture of experts)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError("split_params_into_different_moe_groups_for_optimizer: expected a dict, "
                         f"a list or a tuple of parameter groups, got {type(param_groups).__name__}")
    for index, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"split_params_into_different_moe_groups_for_optimizer: parameter "
                             f"group {index} has no 'params' (got {group!r:.80}); each group is "
                             "a dict like {'params': [...], ...}")
        group["params"] = list(group["params"])
        experts = [i for i, p in enumerate(group["params"]) if is_moe_param(p)]
        if experts:
            raise UnsupportedError(
                f"parameter group {index} ({group.get('name', 'unnamed')!r}) holds expert "
                f"parameters (allreduce=False) at positions {experts[:8]}: zeroshard has no "
                "mixture of experts and would average them across ranks. Run this model under "
                "DeepSpeed itself")
    return param_groups


__all__ = ["is_moe_param", "is_moe_param_group",
           "split_params_into_different_moe_groups_for_optimizer"]
