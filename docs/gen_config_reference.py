"""Write docs/reference/config-keys.md from the config schema: every key zeroshard reads or
accepts, its type, its default, what the key means in DeepSpeed, and what zeroshard does with it
(implements it, warns that it has no effect, or refuses some values).

One source of truth: the pydantic models of `zeroshard.config.schema` (keys, types, defaults,
field docstrings), `config/inert.py` (the keys and values that warn) and the refusals listed in
REFUSED below, which tests/test_docs_config.py checks against `config/refusals.py`.
Run `python docs/gen_config_reference.py` (or `make config-reference`) after changing the
schema; tests/test_docs_config.py fails while the committed page and the schema disagree.

A new key needs a line in MEANING below, or a docstring under its field in the schema (pydantic
reads it as the field's description); the test names the keys that have neither.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "config-keys.md"

# DeepSpeed's meaning of each key, in our words (keys by their path in the JSON).
MEANING: dict[str, str] = {
    # top level
    "train_batch_size": "Samples per optimizer step over all ranks: micro batch x accumulation x world size.",
    "train_micro_batch_size_per_gpu": "Samples one rank processes in one forward/backward.",
    "gradient_accumulation_steps": "Micro-steps whose gradients are summed before each optimizer step.",
    "gradient_clipping": "Clip the global gradient norm to this value; 0 turns clipping off.",
    "fp16": "fp16 mixed precision with loss scaling.",
    "bf16": "bf16 mixed precision (no loss scaling).",
    "torch_autocast": "Run the forward under `torch.autocast` instead of casting the model.",
    "optimizer": "The optimizer the engine builds when the script passes none.",
    "scheduler": "The learning-rate schedule the engine builds when the script passes none.",
    "zero_optimization": "The ZeRO stage and its buckets, offload and stage-3 settings.",
    "aio": "Asynchronous I/O settings of NVMe offload.",
    "steps_per_print": "Log progress every this many steps.",
    "wall_clock_breakdown": "Time forward, backward and step and report the breakdown.",
    "prescale_gradients": "Divide gradients by the world size before summing them rather than after.",
    "gradient_predivide_factor": "Divide gradients by this factor before the sum and by world size / factor after.",
    "communication_data_type": "The dtype gradients are summed across ranks in (`fp32`, `fp16`, `bf16`).",
    "zero_allow_untested_optimizer": "Allow an optimizer DeepSpeed has not tested with ZeRO.",
    "zero_force_ds_cpu_optimizer": "Require DeepSpeed's own CPU Adam when the optimizer is offloaded.",
    "seed": "Random seed the engine sets.",
    "gradient_allreduce_op": "How gradients are combined across ranks: `\"mean\"` averages them, `\"sum\"` adds them (no division by the world size or by `gradient_predivide_factor`).",
    "managed_gradient_accumulation": "`false`: the caller decides the accumulation boundary: `backward()` only accumulates and every `step()` reduces and applies one update.",
    # fp16
    "fp16.enabled": "Train in fp16.",
    "fp16.loss_scale": "A static loss scale; 0 selects dynamic scaling.",
    "fp16.initial_scale_power": "Dynamic scaling starts at 2 to this power.",
    "fp16.loss_scale_window": "Clean steps after which the dynamic scale doubles.",
    "fp16.hysteresis": "Overflows tolerated before the dynamic scale is halved.",
    "fp16.consecutive_hysteresis": "Restore the hysteresis count after each clean step.",
    "fp16.min_loss_scale": "The dynamic scale never goes below this.",
    "fp16.auto_cast": "Cast floating inputs of the forward to fp16.",
    "fp16.fp16_master_weights_and_grads": "Keep master weights and gradients in fp16 instead of fp32.",
    # bf16
    "bf16.enabled": "Train in bf16.",
    "bf16.bf16_master_weights_and_grads": "Keep master weights and the gradients the optimizer reads in bf16.",
    "bf16.bf16_optimizer_states": "Keep the optimizer state in bf16 too.",
    # torch_autocast
    "torch_autocast.enabled": "Turn the autocast forward on.",
    "torch_autocast.dtype": "The autocast dtype.",
    "torch_autocast.lower_precision_safe_modules": "Modules whose gradients may be communicated in the autocast dtype.",
    # optimizer / scheduler
    "optimizer.type": "Optimizer name (`Adam`, `AdamW`, `SGD`, `Adagrad`, `Muon`, ...), matched case-insensitively.",
    "optimizer.params": "Keyword arguments of the optimizer (`lr`, `betas`, `eps`, `weight_decay`, ...; Muon: `muon_lr`, `adam_lr`, `momentum`, `ns_method`, ...).",
    "scheduler.type": "Schedule name: `WarmupLR`, `WarmupDecayLR`, `WarmupCosineLR`, `OneCycle`, `LRRangeTest`.",
    "scheduler.params": "Keyword arguments of the schedule.",
    # zero_optimization
    "zero_optimization.stage": "0: plain data parallelism; 1: shard optimizer state; 2: and gradients; 3: and parameters.",
    "zero_optimization.contiguous_gradients": "Copy gradients into one contiguous buffer as they are produced.",
    "zero_optimization.reduce_scatter": "Average gradients with reduce-scatter instead of all-reduce.",
    "zero_optimization.reduce_bucket_size": "Elements reduced at a time.",
    "zero_optimization.allgather_partitions": "Gather updated parameters with all-gather instead of broadcasts.",
    "zero_optimization.allgather_bucket_size": "Elements all-gathered at a time.",
    "zero_optimization.overlap_comm": "Overlap gradient reduction with backward.",
    "zero_optimization.load_from_fp32_weights": "Restore master weights from the checkpoint's fp32 copy rather than the model's weights.",
    "zero_optimization.elastic_checkpoint": "Allow a checkpoint to be loaded at another world size (stages 1-2).",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "Muon with NVMe optimizer offload: keep the Muon momentum in memory instead of swapping it with the other state.",
    "zero_optimization.offload_optimizer": "Keep master weights and optimizer state in CPU memory or NVMe and step there (ZeRO-Offload).",
    "zero_optimization.offload_optimizer.device": "`none`, `cpu` or `nvme`.",
    "zero_optimization.offload_optimizer.nvme_path": "Directory of the swap files when the device is `nvme`.",
    "zero_optimization.offload_optimizer.buffer_count": "Staging buffers for NVMe optimizer swapping.",
    "zero_optimization.offload_optimizer.pin_memory": "Use page-locked CPU memory for faster copies to the GPU.",
    "zero_optimization.offload_optimizer.pipeline_read": "Read the next swapped-out state while the current one steps.",
    "zero_optimization.offload_optimizer.pipeline_write": "Write the previous state back while the current one steps.",
    "zero_optimization.offload_optimizer.fast_init": "Faster optimizer initialisation when offloading to NVMe.",
    "zero_optimization.offload_optimizer.ratio": "Fraction of the optimizer step to run on the CPU (partial offload).",
    "zero_optimization.offload_param": "Keep stage-3 parameter shards in CPU memory or NVMe (ZeRO-Infinity).",
    "zero_optimization.offload_param.device": "`none`, `cpu` or `nvme`.",
    "zero_optimization.offload_param.nvme_path": "Directory of the swap files when the device is `nvme`.",
    "zero_optimization.offload_param.buffer_count": "Staging buffers for parameters read back from NVMe.",
    "zero_optimization.offload_param.buffer_size": "Size in elements of each such buffer.",
    "zero_optimization.offload_param.max_in_cpu": "Parameter elements kept in CPU memory when the device is `nvme`.",
    "zero_optimization.offload_param.pin_memory": "Use page-locked CPU memory for faster copies to the GPU.",
    "zero_optimization.sub_group_size": "Stage 3: parameters per optimizer sub-group stepped at a time (bounds the step's temporary memory).",
    "zero_optimization.round_robin_gradients": "Spread the copies of offloaded gradients over ranks round-robin.",
    "zero_optimization.ignore_unused_parameters": "Do not fail on parameters that receive no gradient.",
    "zero_optimization.cpu_offload": "Old switch for optimizer offload to the CPU.",
    "zero_optimization.stage3_max_live_parameters": "Stage 3: at most this many gathered parameter elements at a time.",
    "zero_optimization.stage3_max_reuse_distance": "Stage 3: keep a gathered parameter if it is used again within this many elements.",
    "zero_optimization.stage3_prefetch_bucket_size": "Stage 3: elements gathered ahead of use.",
    "zero_optimization.stage3_param_persistence_threshold": "Stage 3: parameters smaller than this stay whole on every rank.",
    "zero_optimization.stage3_model_persistence_threshold": "Stage 3: cap on the total elements kept whole by the persistence threshold.",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "Stage 3: gather the 16-bit weights when the model is saved.",
    "zero_optimization.stage3_module_granularity_threshold": "Stage 3: modules smaller than this are fetched as one leaf.",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "Stage 3: gather parameters with all-reduce instead of all-gather.",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hpZ: a secondary parameter shard inside groups of this many ranks, so backward gathers stay in the node.",
    "zero_optimization.zero_quantized_weights": "ZeRO++ qwZ: all-gather weights as int8 blocks.",
    "zero_optimization.zero_quantized_gradients": "ZeRO++ qgZ: reduce gradients quantized, hierarchically.",
    "zero_optimization.mics_shard_size": "MiCS: shard over groups of this many ranks and replicate across groups; -1 is off.",
    "zero_optimization.memory_efficient_linear": "Stage 3: a linear layer that saves less for backward.",
    "zero_optimization.leaf_module": "Stage 3: modules fetched whole at their forward, with no hooks on their children (DeepSpeed 0.18+), e.g. mixture-of-experts blocks whose experts run in data-dependent order.",
    "zero_optimization.leaf_module.classes": "Leaf module classes, by class name or fully-qualified `module.qualname`.",
    "zero_optimization.leaf_module.names": "Leaf modules by their `named_modules()` name.",
    "zero_optimization.leaf_module.name_suffixes": "Every module whose name ends with one of these is a leaf.",
    "zero_optimization.enable_sanity_checks": "Extra checks for debugging; stage 3: an in-place change to gathered parameters inside GatheredParameters with modifier_rank=None raises on every rank.",
    # aio
    "aio.block_size": "Bytes per I/O request.",
    "aio.queue_depth": "Requests in flight per thread.",
    "aio.thread_count": "I/O threads.",
    "aio.single_submit": "Submit requests one at a time instead of in batches.",
    "aio.overlap_events": "Overlap submitting requests with waiting for completions.",
    "aio.intra_op_parallelism": "Threads that split one request.",
    "aio.use_gds": "Use GPUDirect Storage.",
    # monitoring
    "tensorboard": "Write training metrics for TensorBoard.",
    "tensorboard.enabled": "Turn the TensorBoard writer on.",
    "csv_monitor": "Write training metrics to CSV files.",
    "csv_monitor.enabled": "Turn the CSV writer on.",
    "wandb": "Log training metrics to Weights & Biases.",
    "wandb.enabled": "Turn Weights & Biases logging on.",
    "comet": "Log training metrics to Comet.",
    "comet.enabled": "Turn Comet logging on.",
    "comet.project": "Comet project name.",
    "comet.workspace": "Comet workspace.",
    "comet.api_key": "Comet API key.",
    "comet.experiment_name": "Name of the Comet experiment.",
    "comet.experiment_key": "Key of an existing Comet experiment to continue.",
    "comet.online": "Log online, or offline to local files.",
    "flops_profiler": "Profile the FLOPs, time and parameters of a step, per module.",
    "flops_profiler.enabled": "Turn the profiler on.",
    "comms_logger": "Log the collectives: sizes, times and bandwidth.",
    "comms_logger.enabled": "Turn the communication logger on.",
    "comms_logger.verbose": "Print every collective as it runs.",
    "comms_logger.prof_all": "Profile every collective.",
    "comms_logger.prof_ops": "Profile only the collectives named here.",
    "comms_logger.debug": "Add the caller's name to each record.",
    "activation_checkpointing": "Settings of `deepspeed.checkpointing` (activation checkpointing).",
    "activation_checkpointing.number_checkpoints": "Number of checkpoints, for the contiguous-memory layout.",
    # keys zeroshard accepts and ignores (config/inert.py INERT_KEYS)
    "amp": "NVIDIA Apex automatic mixed precision.",
    "autotuning": "DeepSpeed's autotuner.",
    "checkpoint": "Checkpoint engine options (tag validation, parallel writes).",
    "compile": "`torch.compile` of the engine.",
    "compression_training": "Quantisation and pruning during training.",
    "curriculum_learning": "Sequence-length curriculum.",
    "data_efficiency": "Data sampling and routing for efficiency.",
    "data_types": "Dtype of gradient accumulation.",
    "dataloader_drop_last": "Drop the last incomplete batch of the engine's data loader.",
    "disable_allgather": "Old switch to skip the parameter all-gather.",
    "dump_state": "Print the engine state after initialisation.",
    "eigenvalue": "Eigenvalue computation for progressive layer drop.",
    "elasticity": "Elastic batch-size settings.",
    "graph_harvesting": "CUDA-graph capture of the step.",
    "hybrid_engine": "Switching between training and inference kernels (RLHF).",
    "memory_breakdown": "Print memory use at each stage of a step.",
    "nebula": "Azure Nebula checkpoint service.",
    "pipeline": "Pipeline-parallel settings.",
    "progressive_layer_drop": "Skip layers progressively during training.",
    "quantize_training": "Quantisation-aware training.",
    "seq_parallel_communication_data_type": "Dtype of sequence-parallel communication.",
    "sparse_attention": "Block-sparse attention kernels.",
    "sparse_gradients": "Sparse gradients for embeddings.",
    "tensor_parallel": "Automatic tensor parallelism.",
    "timers": "Throughput timer settings.",
    "weight_quantization": "Post-training weight quantisation.",
    "bf16.immediate_grad_update": "Apply gradients to bf16 parameters as they arrive.",
    "checkpoint.tag_validation": "Check that every rank saves under the same tag: Warn (default), "
                                 "Ignore, or Fail (an assertion error).",
    "checkpoint.load_universal": "Load a DeepSpeed universal checkpoint.",
    "checkpoint.use_node_local_storage": "Each node writes its ranks' files to its own local disk.",
    "checkpoint.parallel_write": "Pipeline stages write their checkpoint files in parallel.",
    "checkpoint.serialization": "Whether DeepSpeed's fast checkpoint writer serializes tensors.",
    "checkpoint.writer": "DeepSpeed's checkpoint writer (decoupled or fast file writes).",
    "optimizer.legacy_fusion": "Old fused-optimizer switch.",
    "zero_optimization.cpu_offload_params": "Old switch for parameter offload to the CPU.",
    "zero_optimization.cpu_offload_use_pin_memory": "Old switch for pinned offload memory.",
    "zero_optimization.legacy_stage1": "DeepSpeed's old stage-1 implementation.",
    "zero_optimization.log_trace_cache_warnings": "Warn when the stage-3 prefetch trace is invalidated.",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS: gather parameters in two levels (node, then cluster).",
    "zero_optimization.override_module_apply": "Stage 3: wrap `Module.apply` to gather parameters.",
    "zero_optimization.pipeline_loading_checkpoint": "Stage 3: load a checkpoint while partitioning.",
    "zero_optimization.use_multi_rank_bucket_allreduce": "Stages 1-2: all-reduce buckets to several ranks at once.",
    "zero_optimization.zeropp_loco_param": "ZeRO++ LoCo: error-compensated gradient quantisation.",
}

# Values zeroshard refuses: key -> which values and why. tests/test_docs_config.py checks that
# every key `config/refusals.py` names is here.
REFUSED: dict[str, str] = {
    "zero_optimization.offload_optimizer.ratio":
        "refuses values below 1 (partial offload): `not supported yet`",
    "bf16.bf16_master_weights_and_grads":
        "refuses it without `bf16_optimizer_states`, and with NVMe optimizer offload: `not supported yet`",
    "zero_optimization.zero_hpz_partition_size":
        "refuses values above 1 below stage 3, values that do not divide the world size, and "
        "`offload_param`",
    "zero_optimization.mics_shard_size":
        "refuses values below stage 3, values that do not divide the world size, and MiCS with "
        "hpZ, offload, `zeroshard.Init` or qwZ/qgZ",
    "gradient_allreduce_op": "refuses `\"sum\"` at stage 3, as DeepSpeed does",
    "managed_gradient_accumulation":
        "refuses `false` together with `zero_optimization.overlap_comm: true` at stages 0-1, as "
        "DeepSpeed does",
    "optimizer.type":
        "refuses optimizers that need whole tensors (LAMB, LARS, LBFGS, Adafactor, ...): their "
        "update would be wrong on shards. `Muon` is built: each matrix is orthogonalised whole "
        "on one owner rank (see the Muon row of the migration guide); a `torch.optim.Muon` "
        "instance is refused",
}

# Keys stored without effect and without a warning (DeepSpeed tuning knobs whose job zeroshard
# does another way): key -> what happens instead.
ACCEPTED: dict[str, str] = {
    "seed": "accepted, no effect: seed torch yourself (`torch.manual_seed`)",
    "zero_force_ds_cpu_optimizer": "accepted, no effect: offloaded steps use torch's fused CPU kernels",
    "zero_optimization.load_from_fp32_weights": "accepted, no effect: masters always load from the checkpoint's fp32 fragments",
    "zero_optimization.ignore_unused_parameters": "accepted, no effect: parameters without a gradient are always allowed",
    "zero_optimization.sub_group_size": "accepted, no effect at stage 3: the optimizer steps unit by unit",
    "zero_optimization.offload_optimizer.fast_init": "accepted, no effect",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "accepted, no effect: Muon's momentum is never swapped (CPU memory under optimizer offload, NVMe included)",
    "zero_optimization.offload_param.buffer_size": "accepted, no effect: staging buffers are sized to the largest unit",
    "zero_optimization.offload_param.max_in_cpu": "accepted, no effect",
    "aio.single_submit": "accepted, no effect",
    "aio.overlap_events": "accepted, no effect",
    "aio.use_gds": "accepted, no effect",
}

# Which function of config/refusals.py refuses which keys, and how many `raise` statements the
# module had when REFUSED was last checked against it (tests/test_docs_config.py compares both).
REFUSAL_FUNCTIONS: dict[str, list[str]] = {
    "require_supported": ["zero_optimization.offload_optimizer.ratio",
                          "bf16.bf16_master_weights_and_grads"],
    "check_hpz": ["zero_optimization.zero_hpz_partition_size"],
    "check_mics": ["zero_optimization.mics_shard_size"],
    "check_elementwise": ["optimizer.type"],
    "check_reduce_and_accumulate": ["gradient_allreduce_op", "managed_gradient_accumulation"],
}
REFUSAL_RAISES = 13

# Types the schema spells with the value types of config/fields.py.
def _named_types() -> dict[str, object]:
    from zeroshard.config import fields as f

    return {"true / false": f.Bool, "string": f.Str, "integer": f.AnyInt, "integer ≥ 0": f.NonNegInt,
            "integer ≥ 1": f.PosInt, "number ≥ 0": f.NonNegFloat, "number > 0": f.PosFloat,
            "integer ≥ 1, or `inf` / null (never)": f.Period,
            '`"none"`, `"cpu"` or `"nvme"`': f.Device}


def _blocks(annotation) -> list[type[BaseModel]]:
    args = typing.get_args(annotation) or (annotation,)
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def schema_keys() -> list[tuple[str, str, object, object, str | None]]:
    """(path, type text, default, field, description) of every key, depth first."""
    from zeroshard.config.schema import ZeroConfig

    named = _named_types()
    rows = []

    def walk(cls: type[BaseModel], prefix: str) -> None:
        hints = typing.get_type_hints(cls, include_extras=True)
        for name, field in cls.model_fields.items():
            path = prefix + name
            blocks = _blocks(field.annotation)
            rows.append((path, _type_text(hints.get(name, field.annotation), field, named, blocks),
                         _default_text(field, blocks), field, field.description))
            for block in blocks:
                walk(block, path + ".")

    walk(ZeroConfig, "")
    return rows


def _type_text(hint, field, named, blocks) -> str:
    if blocks:
        return "object" + (" or null" if type(None) in typing.get_args(field.annotation) else "")
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)) \
            and type(None) in args:
        optional = True
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    for text, value in named.items():
        if hint == value:
            return text + (" or null" if optional else "")
    base = field.annotation
    text = _plain(base)
    return text


def _plain(t) -> str:
    names = {bool: "true / false", int: "integer", float: "number", str: "string",
             type(None): "null"}
    if t in names:
        return names[t]
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return " or ".join(f'`"{a}"`' for a in args)
    if origin in (list,):
        return "list of " + _plain(args[0]) + "s" if args else "list"
    if origin in (dict,):
        return "object"
    if args and (origin is typing.Union or type(t).__name__ == "UnionType"):
        return " or ".join(_plain(a) for a in args)
    if origin is typing.Annotated:
        return _plain(args[0])
    return getattr(t, "__name__", str(t))


def _default_text(field, blocks) -> str:
    if blocks:
        return "—" if field.default is None else "see below"
    if field.is_required():
        return "required"
    value = field.default if field.default is not PydanticUndefined else field.default_factory()
    if value is None:
        return "null"
    if value is True or value is False:
        return str(value).lower()
    if value == sys.maxsize:
        return "sys.maxsize"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1e6:
        return f"{value:.0e}"
    if isinstance(value, int) and abs(value) >= 10_000_000:
        return f"{value:.0e}".replace("e+0", "e").replace("e+", "e")
    if isinstance(value, str):
        return f'`"{value}"`'
    if value == {}:
        return "{}"
    return f"{value:,}".replace(",", "_") if isinstance(value, int) and value >= 100_000 \
        else str(value)


def inert_keys() -> list[tuple[str, str]]:
    from zeroshard.config.inert import INERT_KEYS

    return sorted((f"{block}.{key}" if block else key, msg) for block, keys in INERT_KEYS.items()
                  for key, msg in keys.items())


def warnings_for(path: str) -> list[str]:
    from zeroshard.config.inert import INERT_VALUES

    block, _, key = path.rpartition(".")
    out = []
    for p, k, _fires, template in INERT_VALUES:
        if (p, k) == (block, key):
            out.append(template.format(full=path, key=key, stage="N"))
    return out


def missing_meanings() -> list[str]:
    """Keys with neither a MEANING line nor a field docstring."""
    missing = [path for path, _t, _d, _f, desc in schema_keys() if path not in MEANING and not desc]
    missing += [path for path, _m in inert_keys() if path not in MEANING]
    return missing


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    missing = missing_meanings()
    if missing:
        raise SystemExit("config keys without a meaning: " + ", ".join(missing) + ". Add a line "
                         "for each to MEANING in docs/gen_config_reference.py, or a docstring "
                         "under the field in src/zeroshard/config/schema.py.")
    from zeroshard.config.schema import _ALIASES

    out = [
        "# Config keys",
        "",
        "<!-- Generated by docs/gen_config_reference.py from src/zeroshard/config/ (schema.py,",
        "     inert.py, refusals.py). Do not edit: run `make config-reference`. -->",
        "",
        "Every key of the DeepSpeed JSON config that zeroshard reads, generated from its schema",
        "(`zeroshard/config/schema.py`). *DeepSpeed's meaning* says what the key is for; *zeroshard*",
        "says what happens here: **implemented**; **accepted** — read, without effect or warning;",
        "**warns** — accepted, with a one-line",
        "`ConfigWarning` when the key has no effect (the text below is the warning, `N` the stage);",
        "**refuses** — some values are an error that names the key. A key the schema does not",
        "know is an error that suggests the closest spelling; the rules (batch sizes, `\"auto\"`,",
        "gradient reduction) are on [Config rules](config.md).",
        "",
    ]
    rows = schema_keys()
    parents = [""] + [path for path, _t, _d, field, _desc in rows if _blocks(field.annotation)]
    for parent in parents:
        children = [r for r in rows if r[0].rpartition(".")[0] == parent]
        if parent:
            desc = next(r[4] for r in rows if r[0] == parent)
            out += [f"## `{parent}`", "", _cell(MEANING.get(parent, "") or desc or ""), ""]
        else:
            out += ["## Top level", ""]
        out += ["| key | type | default | DeepSpeed's meaning | zeroshard |", "|---|---|---|---|---|"]
        for path, type_text, default, field, desc in children:
            status = []
            if path in REFUSED:
                status.append("**refuses** " + REFUSED[path])
            status += ["**warns**: " + w for w in warnings_for(path)]
            if path in ACCEPTED:
                status.append("**" + ACCEPTED[path].replace(",", "**,", 1)
                              if "," in ACCEPTED[path] else "**" + ACCEPTED[path] + "**")
            if not status:
                status.append("**implemented**")
            if desc:
                status.append("zeroshard: " + desc)
            out.append(f"| `{path}` | {type_text} | {default} | {_cell(MEANING.get(path) or '—')} "
                       f"| {_cell('; '.join(status))} |")
        out.append("")
    out += ["## Keys accepted and ignored", "",
            "DeepSpeed features zeroshard does not have. The key is accepted, so that a DeepSpeed",
            "config loads, with a one-line `ConfigWarning` naming it; its value is dropped.", "",
            "| key | DeepSpeed's meaning | warning |", "|---|---|---|"]
    for path, msg in inert_keys():
        out.append(f"| `{path}` | {_cell(MEANING[path])} | "
                   f"{_cell(msg.format(full=path, key=path.rpartition('.')[2], stage='N'))} |")
    out += ["", "## Other spellings", "",
            "Other names DeepSpeed accepts for the same setting, read as the key they stand for.",
            "", "| spelling | read as |", "|---|---|"]
    for block, aliases in _ALIASES.items():
        for alias, target in sorted(aliases.items()):
            prefix = block + "." if block else ""
            out.append(f"| `{prefix}{alias}` | `{prefix}{target}` |")
    return "\n".join(out) + "\n"


def main() -> None:
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
