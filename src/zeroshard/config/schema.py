"""DeepSpeed-format JSON config for zeroshard.

Pydantic models of the DeepSpeed config keys that zeroshard reads, ``load_config`` (dict, path or
None -> validated ``ZeroConfig`` with the batch-size rule resolved), errors that name the key path
and suggest the right spelling, one-line ``ConfigWarning``s for keys DeepSpeed accepts but that do
nothing here; what the engine refuses of a valid config is in refusals.py.
The value types the models use (strict numbers, booleans, names) are in `fields.py`.
"""

import base64
import difflib
import json
import os
import sys
import warnings
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from .fields import (AnyInt, Bool, DEEPSPEED_OPTIMIZERS, DEEPSPEED_SCHEDULERS, Device, NonNegFloat,
                     NonNegInt, Period, PosFloat, PosInt, Str, _DTYPE, _check_names, _choice, _float,
                     _int, _match_name, _show)
from .inert import INERT_KEYS, INERT_VALUES
from .leaf_module import LeafModuleConfig
from .monitoring import (SECTIONS as _WATCH_SECTIONS, ActivationCheckpointingConfig, CometConfig,
                         CommsLoggerConfig, CSVMonitorConfig, FlopsProfilerConfig,
                         TensorBoardConfig, WandbConfig)
from .optimizer import optimizer_param_problems

__all__ = [
    "ConfigError", "NotSupportedYetError", "ConfigWarning", "load_config",
    "ZeroConfig", "FP16Config", "BF16Config", "TorchAutocastConfig", "OptimizerConfig",
    "SchedulerConfig",
    "ZeroOptimizationConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "AioConfig",
    "CheckpointConfig",
]


class ConfigError(ValueError):
    """A config problem; the message names the key path, the bad value and what to do."""


class NotSupportedYetError(ConfigError):
    """A valid DeepSpeed setting the engine cannot run yet; message starts 'not supported yet: '."""


class ConfigWarning(UserWarning):
    """Category of the one-line notices about config keys that have no effect here."""


# -- Schema

class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class FP16Config(_Block):
    """fp16 mixed precision; loss_scale 0 = dynamic scaling from 2**initial_scale_power."""
    enabled: Bool = False
    loss_scale: NonNegFloat = 0.0
    initial_scale_power: NonNegInt = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: PosFloat = 1.0
    auto_cast: Bool = False
    fp16_master_weights_and_grads: Bool = False
    """DeepSpeed's fp16 masters; not implemented (masters stay fp32; a notice when fp16 is on)."""


class BF16Config(_Block):
    """bf16 mixed precision (no loss scaling needed)."""
    enabled: Bool = False
    check_grad_overflow: Bool = True
    """Skip a step whose gradients hold inf/nan (counted in skipped_steps, as fp16 overflow);
    false raises NonFiniteGradientError instead (DeepSpeed would apply the step). DeepSpeed's
    default since 0.19.3."""
    bf16_master_weights_and_grads: Bool = False
    """Keep each shard's master weights (and the gradients the optimizer reads) in bf16, not fp32."""
    bf16_optimizer_states: Bool = False
    """Keep the optimizer state (Adam's moments) in bf16 too; needs bf16_master_weights_and_grads."""

    @model_validator(mode="after")
    def _states_need_masters(self):
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16_optimizer_states=true needs bf16_master_weights_and_grads=true "
                             "(as in DeepSpeed): set both, or drop bf16_optimizer_states")
        return self


class TorchAutocastConfig(_Block):
    """torch.autocast around the engine's forward (DeepSpeed's torch_autocast block)."""
    enabled: Bool = False
    dtype: Annotated[str, _choice("bfloat16", "float16", aliases={
        "torch.bfloat16": "bfloat16", "bf16": "bfloat16", "bfloat": "bfloat16",
        "torch.float16": "float16", "fp16": "float16", "half": "float16"})] | None = None
    """None: torch.autocast's own default for the device (float16 on CUDA, bfloat16 on CPU)."""
    lower_precision_safe_modules: Annotated[list[str], BeforeValidator(_check_names)] | None = None
    """DeepSpeed communicates these modules' gradients in `dtype`; accepted, no effect here."""


class OptimizerConfig(_Block):
    """Optimizer the engine builds when the user passes none: DeepSpeed name plus kwargs."""
    type: Annotated[str, _match_name("optimizer", DEEPSPEED_OPTIMIZERS)]
    params: dict[str, Any] = {}


class SchedulerConfig(_Block):
    """Learning-rate scheduler by DeepSpeed name plus its kwargs."""
    type: Annotated[str, _match_name("scheduler", DEEPSPEED_SCHEDULERS)]
    params: dict[str, Any] = {}


class _NvmeBlock(_Block):
    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("device 'nvme' needs nvme_path (a directory on a fast local disk)")
        return self


class OffloadOptimizerConfig(_NvmeBlock):
    """Where the fp32 master weights and optimizer state of each shard live (ZeRO-Offload)."""
    device: Device = "none"
    nvme_path: Str | None = None
    buffer_count: PosInt = 4
    pin_memory: Bool = True
    """Page-locked host buffers on CUDA (no effect on a CPU-only machine); DeepSpeed's default
    since 0.19.5."""
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: _float(0.0, hi=1.0) = 1.0
    zeroshard_step_in_backward: Bool | None = None
    """zeroshard only, device "cpu" at stages 2-3: step each unit's master on the CPU as soon as
    its gradient shard lands during the backward that ends the accumulation window (when there
    is no clipping, no fp16 loss scaling and the optimizer is a fused torch one); false keeps the
    whole step after backward (`offload/early.py`); None (default): on when the compute device
    is an accelerator (on a CPU-only machine backward and the step would share the cores)."""


class OffloadParamConfig(_NvmeBlock):
    """Where stage-3 parameter shards live (ZeRO-Infinity); ignored below stage 3."""
    device: Device = "none"
    nvme_path: Str | None = None
    buffer_count: PosInt = 5
    buffer_size: PosInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000
    pin_memory: Bool = True
    """Page-locked host buffers on CUDA (no effect on a CPU-only machine); DeepSpeed's default
    since 0.19.5."""


class AioConfig(_Block):
    """Asynchronous I/O settings for NVMe offload."""
    block_size: PosInt = 1_048_576
    queue_depth: PosInt = 8
    thread_count: PosInt = 1
    single_submit: Bool = False
    overlap_events: Bool = True
    intra_op_parallelism: PosInt = 1
    use_gds: Bool = False


class CheckpointConfig(_Block):
    """The ``checkpoint`` block: DeepSpeed's tag check (its other keys are inert, inert.py)."""
    tag_validation: Annotated[str, _choice("ignore", "warn", "fail")] = "warn"
    """What a save whose ranks pass different tags does. zeroshard refuses it in every mode, with
    an error that is also an AssertionError (DeepSpeed's "fail"): one save is one directory."""


class ZeroOptimizationConfig(_Block):
    """The ``zero_optimization`` block: stage, buckets, offload and the stage-3 knobs."""
    stage: _int(0, 3) = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: PosInt = 500_000_000
    allgather_partitions: Bool = True
    allgather_bucket_size: PosInt = 500_000_000
    overlap_comm: Bool | None = None
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    sub_group_size: NonNegInt = 1_000_000_000
    round_robin_gradients: Bool = False
    ignore_unused_parameters: Bool = True
    cpu_offload: Bool | None = None
    """Legacy DeepSpeed switch; true means offload_optimizer.device='cpu'."""
    cpu_offload_param: Bool | None = None
    """Legacy DeepSpeed switch; true means offload_param.device='cpu'."""
    stage3_max_live_parameters: NonNegInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_model_persistence_threshold: NonNegInt = sys.maxsize
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: NonNegInt = 0
    stage3_use_all_reduce_for_fetch_params: Bool = False
    zero_hpz_partition_size: PosInt = 1
    zero_quantized_weights: Bool = False
    zero_quantized_gradients: Bool = False
    mics_shard_size: _int(-1) = -1
    memory_efficient_linear: Bool = True
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Modules gathered whole at their forward (DeepSpeed's ZeRO-3 leaf modules), by class, name
    or name suffix; stage 3 makes each one unit (config/leaf_module.py)."""
    zeroshard_unit_classes: Annotated[list[str], BeforeValidator(_check_names)] | None = None
    """zeroshard only: module class names (e.g. ["GPT2Block"]) whose instances each become one
    stage-3 unit, gathered and released together; None picks every repeating module class."""
    zeroshard_desync_timeout: Annotated[float, Field(ge=0)] = 300.0
    """zeroshard only, every stage: seconds a collective may wait before the desync watchdog
    finds out where every rank is and raises DesyncError on each (ranks taking different paths,
    a crashed peer); 0 turns the watchdog off (torch's process-group timeout then applies)."""

    @model_validator(mode="after")
    def _legacy_cpu_offload(self):
        for switch, key, block in (("cpu_offload", "offload_optimizer", OffloadOptimizerConfig),
                                   ("cpu_offload_param", "offload_param", OffloadParamConfig)):
            if not getattr(self, switch):
                continue
            if getattr(self, key) is None:
                setattr(self, key, block(device="cpu"))
            elif getattr(self, key).device != "cpu":
                raise ValueError(f"{switch}=true contradicts {key}.device="
                                 f"'{getattr(self, key).device}'; drop {switch}")
        return self


class ZeroConfig(_Block):
    """A whole validated config; after ``load_config`` the three batch sizes are resolved ints."""
    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    gradient_clipping: NonNegFloat = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off. DeepSpeed's default is
    1.0 since 0.19.3 (0 before)."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroOptimizationConfig = Field(default_factory=ZeroOptimizationConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    steps_per_print: Period = None
    """Print a progress line every N optimizer steps; None (DeepSpeed's default) never."""
    wall_clock_breakdown: Bool = False
    # Watching a run (zeroshard.monitor) and deepspeed.checkpointing (zeroshard.activations).
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    # The gradient reduction (core/reduction.py), with DeepSpeed's meaning; unset
    # communication_data_type sums fp16/bf16 gradients in fp32 (DeepSpeed: in the compute dtype).
    prescale_gradients: Bool = False
    gradient_predivide_factor: PosFloat = 1.0
    communication_data_type: Annotated[str, _DTYPE] | None = None
    gradient_allreduce_op: Annotated[str, _choice("mean", "sum")] = "mean"
    managed_gradient_accumulation: Bool = True
    """With false, set_gradient_accumulation_boundary() and coalesce_grad_reduction() are refused,
    as in DeepSpeed (the caller's step() is the boundary)."""
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True
    seed: AnyInt | None = None

    @model_validator(mode="after")
    def _one_precision(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        if self.bf16.enabled and self.bf16.bf16_master_weights_and_grads \
                and self.zero_optimization.stage == 0:
            raise ValueError("bf16.bf16_master_weights_and_grads needs ZeRO stage 1-3 (the masters "
                             "are the optimizer's shards); set zero_optimization.stage or drop it")
        return self

    def to_dict(self) -> dict:
        """The resolved config as a plain JSON-able dict that ``load_config`` accepts again."""
        # Keys that are inert at this stage and still at their default are left out, so that
        # reloading the dict does not warn about keys the user never wrote.
        exclude: dict[str, Any] = {}
        for path, key, fires, _ in INERT_VALUES:
            block = _block(self, path)
            value = getattr(block, key)
            default = type(block).model_fields[key].get_default(call_default_factory=True)
            if fires(value, self) and value == default:
                node = exclude
                for part in filter(None, path.split(".")):
                    node = node.setdefault(part, {})
                node[key] = True
        return self.model_dump(mode="json", exclude=exclude)


_SCHEMA: dict[str, type[BaseModel]] = {
    "": ZeroConfig, "fp16": FP16Config, "bf16": BF16Config, "torch_autocast": TorchAutocastConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig, "zero_optimization": ZeroOptimizationConfig, "aio": AioConfig,
    "checkpoint": CheckpointConfig,
    "zero_optimization.offload_optimizer": OffloadOptimizerConfig,
    "zero_optimization.offload_param": OffloadParamConfig,
    "zero_optimization.leaf_module": LeafModuleConfig,
    **_WATCH_SECTIONS,
}

# Other spellings DeepSpeed accepts for the same setting (alias -> our field).
_ALIASES: dict[str, dict[str, str]] = {
    "": {"bfloat16": "bf16"},
    "zero_optimization": {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "model_persistence_threshold": "stage3_model_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "module_granularity_threshold": "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    },
}

def _block(cfg: ZeroConfig, path: str) -> BaseModel:
    for part in filter(None, path.split(".")):
        cfg = getattr(cfg, part)
    return cfg


# -- Loading

def _read(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, ZeroConfig):
        return config.to_dict()
    if isinstance(config, str) and not os.path.exists(config) and _is_base64_json(config):
        return _read(json.loads(base64.urlsafe_b64decode(config.encode())))
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file '{path}' does not exist; pass an existing JSON file "
                              "or a dict") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"config file '{path}' is not valid JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno}; fix the file") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file '{path}' cannot be read: {e}") from None
        source = f"config file '{path}'"
    else:
        source = "config"
    if not isinstance(config, dict):
        raise ConfigError(f"{source} must be a JSON object (dict) of DeepSpeed keys, "
                          f"got {type(config).__name__}")
    return _legacy_zero_switch(config)


def _legacy_zero_switch(config: dict) -> dict:
    """DeepSpeed's deprecated `"zero_optimization": true/false` (stage 1 / 0, with the top-level
    `allgather_size`) as the block it stands for; a copy, with a notice."""
    switch = config.get("zero_optimization")
    if not isinstance(switch, bool):
        return config
    config = dict(config)
    stage = 1 if switch else 0
    block: dict[str, Any] = {"stage": stage}
    if "allgather_size" in config:
        size = config.pop("allgather_size")
        if stage:
            block["allgather_bucket_size"] = size
    config["zero_optimization"] = block
    _warn(f"\"zero_optimization\": {json.dumps(switch)} is DeepSpeed's deprecated form; read as "
          f"stage {stage} (write \"zero_optimization\": {{\"stage\": {stage}}})")
    return config


def _is_base64_json(text: str) -> bool:
    """Whether `text` is a base64-encoded JSON object (DeepSpeed accepts configs that way)."""
    try:
        return isinstance(json.loads(base64.urlsafe_b64decode(text.encode())), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def read_raw(config: Any) -> dict:
    """The config as a plain dict: a dict, a JSON file path, or base64-encoded JSON."""
    return _read(config)


def _check_keys(raw: dict, path: str, problems: list[str], inert: list[str]) -> dict:
    """Return raw with aliases renamed and inert keys dropped; note unknown keys in problems."""
    cls = _SCHEMA[path]
    aliases = _ALIASES.get(path, {})
    inert_here = INERT_KEYS.get(path, {})
    out: dict = {}
    for key, value in raw.items():
        key = str(key)
        full = _join(path, key)
        if key in aliases:
            target = aliases[key]
            if target in raw and raw[target] != value:
                problems.append(f"'{full}' and '{_join(path, target)}' are the same setting with "
                                f"different values ({_show(value)} vs {_show(raw[target])}); "
                                "keep one")
            key = target
        if key in cls.model_fields:
            child = _join(path, key)
            if child in _SCHEMA and isinstance(value, dict):
                value = _check_keys(value, child, problems, inert)
            out[key] = value
        elif key in inert_here:
            inert.append(inert_here[key].format(full=full, key=key))
        elif not path and "." in key:
            # TRL writes Hugging Face's "auto" fill-ins ("zero_optimization.reduce_bucket_size")
            # as top-level keys into the config it hands to initialize(); DeepSpeed ignores
            # top-level keys it does not know, so these never reach its ZeRO settings.
            inert.append(f"'{full}' is a top-level key with a dot in its name: DeepSpeed "
                         "ignores it and so does zeroshard (nest it to set that value)")
        else:
            # Real field names first: an alias or inert key is a worse suggestion than a field.
            close = (difflib.get_close_matches(key, list(cls.model_fields), n=2, cutoff=0.6)
                     or difflib.get_close_matches(key, [*aliases, *inert_here], n=2, cutoff=0.6))
            if close:
                hint = " — did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
            else:
                where = f" in {path}" if path else ""
                hint = f"; valid keys{where}: " + ", ".join(cls.model_fields)
            problems.append(f"unknown key '{full}'{hint} (fix the spelling or remove it)")
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _explain(err: ValidationError) -> list[str]:
    """Turn pydantic's errors into one plain line each: key path, value, expectation."""
    lines = []
    for e in err.errors(include_url=False):
        path = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in e["loc"])
        path = path.replace(".[", "[")
        kind, msg = e["type"], e["msg"]
        if kind == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif kind in ("model_type", "dict_type", "model_attributes_type"):
            msg = "expected a JSON object {...}"
        elif kind == "missing":
            lines.append(f"{path}: required key is missing")
            continue
        elif kind == "extra_forbidden":
            msg = "unknown key"
        else:
            msg = msg[:1].lower() + msg[1:]
        if not path:
            lines.append(msg)
        elif isinstance(e.get("input"), dict) and kind == "value_error":
            lines.append(f"{path}: {msg}")
        else:
            lines.append(f"{path} = {_show(e.get('input'))}: {msg}")
    return lines


def _raise(problems: list[str]) -> None:
    if len(problems) == 1:
        raise ConfigError(f"invalid config: {problems[0]}")
    raise ConfigError(f"invalid config ({len(problems)} problems):\n  - "
                      + "\n  - ".join(problems))


def _warn(message: str) -> None:
    """One line per notice, once per process, from rank 0 only: every rank reads the same config.

    Issued with an explicit location ("zeroshard config") so that Python prints the message alone
    instead of echoing a source line of ours, and repeats of the same notice (Init and initialize
    both load the config) are shown once.
    """
    if _rank() != 0:
        return
    warnings.warn_explicit(message, ConfigWarning, "zeroshard config", 0, module="zeroshard.config",
                           registry=globals().setdefault("__warningregistry__", {}))


def _rank() -> int:
    """This process's rank (torchrun's RANK before the process group exists), 0 alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def _resolve_batch(tbs: int | None, micro: int | None, gas: int | None,
                   world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro * accumulation * world_size."""
    def fail(why: str) -> ConfigError:
        given = lambda v: "not given" if v is None else v  # noqa: E731
        return ConfigError(
            f"batch sizes {why}: train_batch_size={given(tbs)}, train_micro_batch_size_per_gpu="
            f"{given(micro)}, gradient_accumulation_steps={given(gas)}, world_size={world_size}; "
            "train_batch_size must equal train_micro_batch_size_per_gpu x "
            "gradient_accumulation_steps x world_size — fix one value or drop one to have it "
            "computed")

    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world_size:
            raise fail(f"contradict each other ({micro} x {gas} x {world_size} = "
                       f"{micro * gas * world_size}, not {tbs})")
        return tbs, micro, gas
    if tbs is not None:
        per_rank = micro if micro is not None else gas if gas is not None else 1
        if tbs % (per_rank * world_size):
            raise fail(f"do not divide ({tbs} is not a multiple of {per_rank} x {world_size})")
        third = tbs // (per_rank * world_size)
        return (tbs, micro, third) if micro is not None else (tbs, third, gas or 1)
    if micro is None and gas is None:
        _warn(f"no batch size given (train_batch_size, train_micro_batch_size_per_gpu, "
              f"gradient_accumulation_steps); using micro batch 1, accumulation 1, "
              f"train_batch_size {world_size} (= world size)")
    micro, gas = micro or 1, gas or 1
    return micro * gas * world_size, micro, gas


def load_config(config: Any = None, world_size: int = 1) -> ZeroConfig:
    """Validate a DeepSpeed-format config (dict, JSON path, ZeroConfig or None) into ZeroConfig."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    raw = _read(config)
    problems: list[str] = []
    inert: list[str] = []
    cleaned = _check_keys(raw, "", problems, inert)
    try:
        cfg = ZeroConfig.model_validate(cleaned)
    except ValidationError as e:
        problems.extend(_explain(e))
    else:
        if cfg.optimizer is not None:
            problems.extend(optimizer_param_problems(cfg.optimizer.type, cfg.optimizer.params))
    if problems:
        _raise(problems)
    tbs, micro, gas = _resolve_batch(cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                                     cfg.gradient_accumulation_steps, world_size)
    # Notices only once the config is known to load, so that a failing load prints just the error.
    for message in inert:
        _warn(message)
    stage = cfg.zero_optimization.stage
    for path, key, fires, template in INERT_VALUES:
        block = _block(cfg, path)
        if key in block.model_fields_set and fires(getattr(block, key), cfg):
            _warn(template.format(full=_join(path, key), key=key, stage=stage))
    return cfg.model_copy(update={"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro,
                                  "gradient_accumulation_steps": gas})
