"""DeepSpeed's `deepspeed.zero` namespace (also `deepspeed.runtime.zero`): `zero.Init`,
`zero.GatheredParameters`, `ZeroParamStatus`, `register_external_parameter`,
`unwrap_model_for_generation` and, for scripts written against DeepSpeed 0.19.6 and earlier,
`MiCS_Init`."""

from __future__ import annotations

import contextlib
import warnings

import torch.distributed as dist

from ...config.schema import load_config, read_raw
from ...dist import init_distributed
from ...core.gathered import GatheredParameters
from ...core.init import Init, load_full_state_dict
from ...core.layout import ZeroParamStatus
from ...core.partition import register_external_parameter

__all__ = ["GatheredParameters", "Init", "MiCS_Init", "ZeroParamStatus", "load_full_state_dict",
           "partitioned_param_data_shape", "register_external_parameter",
           "unwrap_model_for_generation"]

#: The shape of a partitioned parameter's `.data` outside GatheredParameters (DeepSpeed's name):
#: empty; `ds_shape` holds the real shape and `ds_tensor` this rank's slice.
partitioned_param_data_shape = [0]


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """DeepSpeed's: `model` (an engine) with every stage-3 parameter gathered once for the block
    and its per-module gathering out of the way, so generation makes no collective per token;
    yields `model` itself. At stages 0-2 it only yields (parameters are whole)."""
    policy = getattr(getattr(model, "optimizer", None), "policy", None)
    hold_all = getattr(policy, "hold_all", None)
    if hold_all is not None:
        with hold_all():
            yield model
        return
    with GatheredParameters(list(model.parameters())):  # a module built under Init, or nothing
        yield model


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's MiCS construction context (0.19.6 and earlier; 0.19.8 removed MiCS). It needs
    a config with `zero_optimization.mics_shard_size`; zeroshard builds the model whole (its MiCS
    cannot start from a model built partitioned) and shards it over the MiCS groups at
    `initialize()`."""

    def __init__(self, module=None, data_parallel_group=None, sequence_data_parallel_group=None,
                 mem_efficient_linear=True, remote_device=None, pin_memory=False,
                 config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None):
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is None:
            raise ValueError("MiCS_Init needs config_dict_or_path=<a config with "
                             "zero_optimization.mics_shard_size> (as in DeepSpeed)")
        raw = {k: v for k, v in read_raw(source).items() if v != "auto"}
        zero = raw.get("zero_optimization")
        if isinstance(zero, dict):
            raw["zero_optimization"] = {k: v for k, v in zero.items() if v != "auto"}
        init_distributed()  # as Init does: the batch-size rule needs the world size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # initialize() reports the config's notices
            zero = load_config(raw, dist.get_world_size()).zero_optimization
        if enabled and (zero.mics_shard_size <= 0 or zero.stage != 3):
            raise ValueError(
                f"MiCS_Init needs zero_optimization.stage 3 and mics_shard_size > 0 in its config "
                f"(got stage {zero.stage}, mics_shard_size {zero.mics_shard_size}); set both, or "
                "use zero.Init for plain stage 3")
        if enabled:
            warnings.warn("zeroshard: MiCS_Init builds the model whole on each rank; "
                          "initialize() then shards it over the MiCS groups of "
                          f"mics_shard_size={zero.mics_shard_size}", stacklevel=2)
        super().__init__(config=source, enabled=False)
