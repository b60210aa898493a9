"""DeepSpeed's ZeRO config models (`deepspeed.runtime.zero.config` and `.offload_config`):
`DeepSpeedZeroConfig`, `DeepSpeedZeroOffloadOptimizerConfig`, `DeepSpeedZeroOffloadParamConfig`,
`ZeroStageEnum`, `OffloadDeviceEnum`, `get_zero_config`.

Callers build them from a config's `zero_optimization` block (`DeepSpeedZeroConfig(**block)`,
with Hugging Face's "auto" values left out unless `strict=True`, as DeepSpeed does) and read
attributes: `.stage`, `.offload_optimizer.device`, `.gather_16bit_weights_on_model_save`. Here they
are pydantic views over zeroshard's own schema (`config/schema.py`): the block is checked by
zeroshard's loader (the same errors naming the key as `initialize()` gives, the same aliases), and
each field of the schema is an attribute under DeepSpeed's name (`prefetch_bucket_size` for
`stage3_prefetch_bucket_size`, which is accepted as the alias, as in DeepSpeed). DeepSpeed 0.19.8
fields that zeroshard accepts without effect, or does not read, are attributes with DeepSpeed's
defaults. As in DeepSpeed: `stage` is an int, `device` a string equal to `OffloadDeviceEnum`
members, `nvme_path` a `Path`, and an unset `overlap_comm` reads `stage == 3`.
"""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from ...config.inert import INERT_KEYS
from ...config.schema import (OffloadOptimizerConfig, OffloadParamConfig, ZeroOptimizationConfig,
                              load_config)

__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig",
           "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum", "ZERO_OPTIMIZATION",
           "ZeroStageEnum", "get_zero_config"]

ZERO_OPTIMIZATION = "zero_optimization"


class ZeroStageEnum(int, Enum):
    """The ZeRO stages (DeepSpeed's enum)."""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives (DeepSpeed's enum)."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# Our schema's name -> DeepSpeed's field name (ours is its alias there).
_RENAMED = {f"stage3_{name}": name for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params")}

# DeepSpeed 0.19.8 fields our schema does not have, with DeepSpeed's defaults: readable, and
# writable where zeroshard accepts the key (config/inert.py), refused as unknown keys otherwise.
_ZERO_ONLY = {"use_multi_rank_bucket_allreduce": True, "compute_grad_norm": True,
              "zenflow": None, "cpu_offload_param": None, "cpu_offload_use_pin_memory": None,
              "allgather_sequential": False, "stage3_gather_fp16_weights_on_model_save": False,
              "legacy_stage1": False, "parameter_alignment": False,
              "zero_quantized_nontrainable_weights": False, "pipeline_loading_checkpoint": False,
              "override_module_apply": True, "log_trace_cache_warnings": False,
              "save_muon_momentum_buffer_in_memory": False}
_OPTIMIZER_ONLY = {"super_offload": False, "cpuadam_cores_perc": 0.8}


class _View(BaseModel):
    """A DeepSpeed-named view of one block of zeroshard's schema."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", protected_namespaces=())
    _schema: ClassVar[type[BaseModel]]
    _path: ClassVar[str]  # where the block sits in a config
    _only: ClassVar[dict[str, Any]] = {}
    _nested: ClassVar[dict[str, type["_View"]]] = {}

    def __init__(self, strict: bool = False, **data):
        if not strict:  # DeepSpeed drops Hugging Face's "auto" values unless strict
            data = {k: v for k, v in data.items() if v != "auto"}
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _through_schema(cls, data: Any) -> Any:
        if isinstance(data, cls._schema):
            return cls._values(data, {})
        if not isinstance(data, dict):
            return data
        to_ours = {ds: ours for ours, ds in _RENAMED.items()}
        block, kept = {}, {}
        inert = INERT_KEYS.get(cls._path, {})
        for key, value in data.items():
            if key in cls._only and key not in cls._schema.model_fields:
                kept[key] = value
                if key not in inert:
                    block[key] = value  # refused by the loader, naming it
                continue
            if isinstance(value, _View):
                value = value._to_zeroshard()
            block[to_ours.get(key, key)] = value
        return cls._values(cls._load(block), kept)

    @classmethod
    def _load(cls, block: dict) -> BaseModel:
        """The block validated by zeroshard's loader, quietly (initialize() gives the notices)."""
        parts = cls._path.split(".")
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        if len(parts) == 1:
            config[parts[0]] = block
        else:  # an offload block, read at stage 3 where it applies
            config[parts[0]] = {"stage": 3, parts[1]: block}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded: Any = load_config(config)
        for part in cls._path.split("."):
            loaded = getattr(loaded, part)
        return loaded

    @classmethod
    def _values(cls, ours: BaseModel, kept: dict) -> dict:
        out: dict[str, Any] = {}
        for name in type(ours).model_fields:
            value = getattr(ours, name)
            view = cls._nested.get(name)
            if view is not None and value is not None:
                value = view.model_validate(value)
            elif name == "nvme_path" and value is not None:
                value = Path(value)
            out[_RENAMED.get(name, name)] = value
        for name, default in cls._only.items():
            out.setdefault(name, kept.get(name, default))
        if "overlap_comm" in out and out["overlap_comm"] is None:
            out["overlap_comm"] = out["stage"] == ZeroStageEnum.weights
        return out

    def _to_zeroshard(self) -> dict:
        """This block as zeroshard's config keys (what `initialize()` accepts)."""
        out = {}
        for name, value in self:
            if name in self._only and name not in self._schema.model_fields:
                continue
            if isinstance(value, _View):
                value = value._to_zeroshard()
            elif isinstance(value, BaseModel):  # a section kept as zeroshard's model (leaf_module)
                value = value.model_dump()
            elif isinstance(value, Path):
                value = str(value)
            out[{ds: ours for ours, ds in _RENAMED.items()}.get(name, name)] = value
        return out


def _view(name: str, schema: type[BaseModel], path: str, only: dict, nested: dict, doc: str):
    fields: dict[str, Any] = {}
    for ours, info in schema.model_fields.items():
        ds = _RENAMED.get(ours, ours)
        kind = nested.get(ours, Any)
        extra = {"alias": ours} if ds != ours else {}
        fields[ds] = (kind | None if kind is not Any else Any,
                      Field(default=None, description=info.description, **extra))
    for key, default in only.items():
        fields.setdefault(key, (Any, Field(default=default)))
    cls = create_model(name, __base__=_View, __doc__=doc,
                       __module__="zeroshard.compat.deepspeed.zero_config", **fields)
    cls._schema, cls._path, cls._only, cls._nested = schema, path, only, nested
    return cls


DeepSpeedZeroOffloadParamConfig = _view(
    "DeepSpeedZeroOffloadParamConfig", OffloadParamConfig, "zero_optimization.offload_param", {}, {},
    "Stage-3 parameter offload (`zero_optimization.offload_param`).")
DeepSpeedZeroOffloadOptimizerConfig = _view(
    "DeepSpeedZeroOffloadOptimizerConfig", OffloadOptimizerConfig,
    "zero_optimization.offload_optimizer", _OPTIMIZER_ONLY, {},
    "Optimizer offload (`zero_optimization.offload_optimizer`).")
DeepSpeedZeroOffloadOptimizerConfig.pipeline = property(
    lambda self: bool(self.pipeline_read or self.pipeline_write),
    doc="pipeline_read or pipeline_write (DeepSpeed's derived flag).")
DeepSpeedZeroConfig = _view(
    "DeepSpeedZeroConfig", ZeroOptimizationConfig, ZERO_OPTIMIZATION, _ZERO_ONLY,
    {"offload_param": DeepSpeedZeroOffloadParamConfig,
     "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig},
    "The `zero_optimization` block under DeepSpeed's attribute names.")


def get_zero_config(param_dict: dict) -> Any:
    """DeepSpeed's: the `DeepSpeedZeroConfig` of a whole config dict (its deprecated
    `"zero_optimization": true` form included)."""
    block = param_dict.get(ZERO_OPTIMIZATION, {})
    if isinstance(block, bool):
        block = {"stage": 1 if block else 0}
        if block["stage"] and "allgather_size" in param_dict:
            block["allgather_bucket_size"] = param_dict["allgather_size"]
    return DeepSpeedZeroConfig(**block)
