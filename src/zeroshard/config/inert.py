"""DeepSpeed config keys that zeroshard accepts but that do nothing here: the one list to edit
when a feature lands. `config.py` warns once per load for each (never drops one silently).
Templates may use {full} (key path), {key} and {stage}."""

from __future__ import annotations

from typing import Any

_NO_EFFECT = "{full} has no effect in zeroshard; ignored"

# Keys that are not part of our schema at all; they are dropped after the warning.
INERT_KEYS: dict[str, dict[str, str]] = {
    "": {k: _NO_EFFECT for k in (
        "amp", "sparse_attention", "pipeline", "elasticity",
        "data_efficiency", "curriculum_learning", "compression_training", "autotuning",
        "data_types", "dump_state", "sparse_gradients", "memory_breakdown",
        "disable_allgather", "dataloader_drop_last", "eigenvalue", "progressive_layer_drop",
        "quantize_training", "hybrid_engine", "nebula", "compile", "weight_quantization",
        "graph_harvesting", "timers", "tensor_parallel",
        "seq_parallel_communication_data_type")},
    "bf16": {"immediate_grad_update": _NO_EFFECT},
    "checkpoint": {k: _NO_EFFECT for k in (
        "load_universal", "use_node_local_storage", "parallel_write", "serialization", "writer")},
    "optimizer": {"legacy_fusion": _NO_EFFECT},
    "zero_optimization": {k: _NO_EFFECT for k in (
        "legacy_stage1", "cpu_offload_use_pin_memory",
        "mics_hierarchical_params_gather", "use_multi_rank_bucket_allreduce",
        "zeropp_loco_param", "log_trace_cache_warnings", "pipeline_loading_checkpoint",
        "override_module_apply")},
}

_STAGE3_ONLY = "{full} only applies to ZeRO stage 3; ignored at stage {stage} (no effect here)"


# Fields of our schema that are stored but inert when fires(value, cfg) is true and the key was
# written in the config: (block path, key, fires, message template).
INERT_VALUES: list[tuple[str, str, Any, str]] = [
    *[("zero_optimization", k, lambda v, c: c.zero_optimization.stage < 3, _STAGE3_ONLY) for k in (
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "sub_group_size", "memory_efficient_linear",
        "zeroshard_unit_classes", "leaf_module")],
    # Accepted at stage 3 but not implemented: unit modules, persistence and gathering are chosen
    # by zeroshard's own rules (stage3_param_persistence_threshold, zeroshard_unit_classes).
    *[("zero_optimization", k, lambda v, c: c.zero_optimization.stage == 3, _NO_EFFECT) for k in (
        "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params", "memory_efficient_linear")],
    ("zero_optimization", "offload_param",
     lambda v, c: v is not None and v.device != "none" and c.zero_optimization.stage < 3,
     "offload_param only applies to ZeRO stage 3; ignored at stage {stage} "
     "({full} has no effect here)"),
    ("zero_optimization", "offload_optimizer",
     lambda v, c: v is not None and v.device != "none" and c.zero_optimization.stage == 0,
     "offload_optimizer only applies to ZeRO stages 1-3; ignored at stage 0 "
     "({full} has no effect here)"),
    ("zero_optimization", "cpu_offload", lambda v, c: v is not None,
     "{full} is a deprecated DeepSpeed key (true means zero_optimization.offload_optimizer.device="
     "'cpu'); write offload_optimizer instead"),
    ("zero_optimization", "cpu_offload_param", lambda v, c: v is not None,
     "{full} is a deprecated DeepSpeed key (true means zero_optimization.offload_param.device="
     "'cpu'); write offload_param instead"),
    ("zero_optimization", "round_robin_gradients", lambda v, c: v, _NO_EFFECT),
    ("zero_optimization", "elastic_checkpoint", lambda v, c: v,
     "{full} has no effect in zeroshard (checkpoints always reshard on load); ignored"),
    # ZeRO++ qwZ / qgZ (core/zeropp/): stage 3 only, as in DeepSpeed (whose stages 1-2
    # ignore them without a word).
    *[("zero_optimization", k, lambda v, c: v and c.zero_optimization.stage < 3, _STAGE3_ONLY)
      for k in ("zero_quantized_weights", "zero_quantized_gradients")],
    # fp16-only keys say something only when fp16 is on (DeepSpeed's examples write them anyway).
    ("fp16", "auto_cast", lambda v, c: v and c.fp16.enabled,
     "{full} has no effect in zeroshard (the engine already casts floating inputs to the "
     "compute dtype); ignored"),
    ("fp16", "fp16_master_weights_and_grads", lambda v, c: v and c.fp16.enabled,
     "{full}=true has no effect in zeroshard (fp16 training keeps fp32 masters); ignored"),
    ("torch_autocast", "lower_precision_safe_modules",
     lambda v, c: v is not None and c.torch_autocast.enabled,
     "{full} has no effect in zeroshard (gradients are communicated in the parameters' dtype; "
     "the forward runs under torch.autocast as configured); ignored"),
    ("torch_autocast", "dtype", lambda v, c: v == "float16" and c.torch_autocast.enabled,
     "{full}=float16: the forward runs under float16 autocast without loss scaling (as DeepSpeed "
     "with ZeRO), so small gradients can underflow; bfloat16 does not need scaling"),
    ("zero_optimization", "reduce_scatter", lambda v, c: not v,
     "{full}=false has no effect: zeroshard always reduce-scatters gradients at stages 1-2 "
     "(and all-reduces at stage 0); ignored"),
    ("zero_optimization", "allgather_partitions", lambda v, c: not v,
     "{full}=false has no effect: zeroshard always all-gathers updated shards; ignored"),
    ("zero_optimization", "contiguous_gradients", lambda v, c: not v,
     "{full}=false has no effect: zeroshard's gradients always live in contiguous flat "
     "buffers; ignored"),
    ("zero_optimization", "enable_sanity_checks", lambda v, c: v and c.zero_optimization.stage < 3,
     "{full}=true has no effect below ZeRO stage 3 (it makes GatheredParameters refuse in-place "
     "writes to partitioned parameters under modifier_rank=None); ignored at stage {stage}"),
    ("zero_optimization", "ignore_unused_parameters", lambda v, c: not v,
     "{full}=false has no effect: zeroshard never stops on parameters that got no gradient in "
     "a backward (they count as zero gradients at every stage); ignored"),
    ("checkpoint", "tag_validation", lambda v, c: v != "fail",
     "{full} other than 'fail' has no effect: zeroshard refuses a save whose ranks pass "
     "different tags in every mode, as DeepSpeed's 'fail' does (with an AssertionError): a "
     "sharded checkpoint is one directory that every rank writes"),
    ("", "zero_allow_untested_optimizer", lambda v, c: v,
     "{full} has no effect in zeroshard (any elementwise torch.optim optimizer is sharded); "
     "ignored"),
]
