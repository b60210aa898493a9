"""Accelerate's ways of choosing ZeRO, turned into one DeepSpeed config for `Accelerator`:

* the YAML `accelerate config` writes (`zeroshard run --config_file accelerate.yaml` reads its
  launch part and hands the file to the workers through ZEROSHARD_ACCELERATE_CONFIG);
* `DeepSpeedPlugin(zero_stage=..., offload_optimizer_device=..., hf_ds_config=...)`;
* `Accelerator(zero_stage=..., mixed_precision=..., deepspeed_config=...)` keywords;
* a DeepSpeed JSON config (`deepspeed_config_file` in the YAML, `hf_ds_config`, `deepspeed_config=`).

What the script says wins over what the launcher's YAML says. Two places of the same origin that
disagree (a plugin field and its JSON, the YAML's zero_stage and its deepspeed_config_file) are an
error naming both, as in Accelerate.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ...config.schema import read_raw

ENV = "ZEROSHARD_ACCELERATE_CONFIG"
#: Accelerate's field -> the DeepSpeed config key it sets.
SETTINGS = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
PRECISIONS = ("no", "fp16", "bf16")
# YAML keys read elsewhere or harmless; anything else in the file gets a notice.
_LAUNCH_KEYS = {"num_processes", "num_machines", "machine_rank", "main_process_ip",
                "main_process_port", "rdzv_backend", "use_cpu", "gpu_ids", "mixed_precision",
                "distributed_type", "deepspeed_config"}
_QUIET_KEYS = {"compute_environment", "debug", "downcast_bf16", "main_training_function",
               "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "enable_cpu_affinity",
               "dynamo_config", "commands", "command_file", "tpu_name", "tpu_zone", "ipex_config",
               "mpirun_config", "fsdp_config", "megatron_lm_config"}
_DS_KEYS = set(SETTINGS) | {"deepspeed_config_file", "zero3_init_flag", "deepspeed_hostfile",
                            "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
                            "deepspeed_multinode_launcher", "deepspeed_moe_layer_cls_names"}
_DISTRIBUTED = {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "MULTI_NPU", "MULTI_XPU"}


@dataclass
class DeepSpeedPlugin:
    """Accelerate's DeepSpeedPlugin: an Accelerator's ZeRO settings (Accelerate's field names)."""

    hf_ds_config: Any = None
    """A DeepSpeed config (dict, JSON path or base64); its keys count as given in code."""
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    """Build the model partitioned: with zeroshard, `with zeroshard.Init(config=...)`."""
    zero3_save_16bit_model: bool | None = None


@dataclass
class AccelerateConfig:
    """What an `accelerate config` YAML says (the launch part and the training part)."""

    path: str
    num_processes: int | None = None
    num_machines: int = 1
    machine_rank: int = 0
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str | None = None
    use_cpu: bool = False
    gpu_ids: str | None = None
    distributed_type: str = "NO"
    debug: bool = False
    mixed_precision: str | None = None
    deepspeed: dict = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)


def read_accelerate_config(path: str) -> AccelerateConfig:
    """Read and check an `accelerate config` YAML; problems name the key and the file."""
    import yaml  # PyYAML, as accelerate itself reads these files

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as err:
        raise ValueError(f"accelerate config {path}: cannot be read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"accelerate config {path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"accelerate config {path}: expected a mapping of Accelerate's keys")
    out = AccelerateConfig(path=os.path.abspath(path))
    kind = str(data.get("distributed_type") or "NO").upper()
    if kind not in _DISTRIBUTED:
        raise ValueError(f"accelerate config {path}: distributed_type: {kind} is not run by "
                         "zeroshard, which trains with ZeRO; write distributed_type: DEEPSPEED "
                         "and a deepspeed_config section (zero_stage, offload_*_device)")
    out.distributed_type, out.debug = kind, bool(data.get("debug") or False)
    for key in ("num_processes", "num_machines", "machine_rank", "main_process_port"):
        if data.get(key) is not None:
            setattr(out, key, _int(data[key], key, path))
    for key in ("main_process_ip", "rdzv_backend", "gpu_ids"):
        if data.get(key) not in (None, ""):
            setattr(out, key, str(data[key]))
    out.use_cpu = bool(data.get("use_cpu") or False)
    if "mixed_precision" in data and data["mixed_precision"] is not None:
        out.mixed_precision = check_precision(data["mixed_precision"], f"{path}: mixed_precision")
    section = data.get("deepspeed_config") or {}
    if not isinstance(section, dict):
        raise ValueError(f"accelerate config {path}: deepspeed_config must be a mapping")
    out.deepspeed = dict(section)
    unknown = sorted(set(data) - _LAUNCH_KEYS - _QUIET_KEYS)
    unknown += sorted(f"deepspeed_config.{k}" for k in set(section) - _DS_KEYS)
    if unknown:
        out.notices.append(f"accelerate config {path}: {', '.join(unknown)} "
                           f"{'has' if len(unknown) == 1 else 'have'} no effect in zeroshard")
    if data.get("enable_cpu_affinity"):
        out.notices.append(f"accelerate config {path}: enable_cpu_affinity has no effect; use "
                           "zeroshard run --bind_cores_to_rank")
    return out


#: The deepspeed_config keys of an accelerate YAML -> the variable `accelerate launch` sets for each.
LAUNCH_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}


def launch_env(cfg: AccelerateConfig) -> dict[str, str]:
    """The environment `accelerate launch` gives its DeepSpeed workers for this config, so that
    the real `accelerate.Accelerator` (and transformers' Trainer) take their DeepSpeed path: empty
    unless `distributed_type: DEEPSPEED`."""
    if cfg.distributed_type != "DEEPSPEED":
        return {}
    env = {"ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_MIXED_PRECISION": cfg.mixed_precision or "no"}
    given = list(cfg.deepspeed) + (["mixed_precision"] if cfg.mixed_precision else [])
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(given)
    for key, name in LAUNCH_ENV.items():
        value = cfg.deepspeed.get(key)
        if value is None:
            continue
        if key == "deepspeed_config_file":
            value = os.path.abspath(str(value))  # as accelerate reads it: from the working dir
        env[name] = str(value).lower() if isinstance(value, bool) else str(value)
    if cfg.debug:
        env["ACCELERATE_DEBUG_MODE"] = "true"
    return env


def check_precision(value, what: str) -> str:
    """Accelerate's mixed_precision value ("no", "fp16", "bf16"); YAML's bare `no` reads False."""
    text = "no" if value is False else str(value).lower()
    if text not in PRECISIONS:
        raise ValueError(f"{what} = {value!r}: zeroshard supports {', '.join(PRECISIONS)}"
                         + (" (fp8 is not supported)" if text == "fp8" else ""))
    return text


def build_deepspeed_config(*, arguments: dict, plugin: DeepSpeedPlugin | None,
                           deepspeed_config=None, launcher: AccelerateConfig | None) -> dict:
    """One DeepSpeed config (a dict, "auto" values left for prepare) from the Accelerator's
    keyword `arguments` (SETTINGS keys and mixed_precision), a DeepSpeedPlugin, a JSON config and
    the launcher's YAML. Raises ValueError for two same-origin places that disagree."""
    code_json = deepspeed_config if deepspeed_config is not None else \
        (plugin.hf_ds_config if plugin is not None else None)
    if deepspeed_config is not None and plugin is not None and plugin.hf_ds_config is not None:
        raise ValueError("both Accelerator(deepspeed_config=...) and DeepSpeedPlugin(hf_ds_config"
                         "=...) were given; pass the DeepSpeed config once")
    ds_yaml = launcher.deepspeed if launcher is not None else {}
    yaml_json = ds_yaml.get("deepspeed_config_file")
    base_source = code_json if code_json is not None else yaml_json
    config = copy.deepcopy(read_raw(base_source)) if base_source else {}
    base_view = {key: _current(config, key) for key in [*SETTINGS, "mixed_precision"]}
    plugin_values = {f.name: getattr(plugin, f.name) for f in fields(plugin)} if plugin else {}
    yaml_values = dict(ds_yaml, mixed_precision=launcher.mixed_precision if launcher else None)
    yaml_name = f"accelerate config {launcher.path}" if launcher else ""
    # Highest precedence first: (description, origin, values).
    layers = [("Accelerator(...)", "code", arguments), ("DeepSpeedPlugin(...)", "code", plugin_values)]
    if code_json is not None:
        layers.append((_name(code_json), "code", base_view))
    layers.append((yaml_name, "launcher", yaml_values))
    if code_json is None and yaml_json:
        layers.append((_name(yaml_json), "launcher", base_view))
    for key in [*SETTINGS, "mixed_precision"]:
        given = [(name, origin, _convert(key, values[key]))
                 for name, origin, values in layers if values.get(key) is not None]
        if not given:
            continue
        winner = given[0]
        for other in given[1:]:
            if other[1] == winner[1] and other[2] != winner[2]:
                raise ValueError(f"{_describe(key, winner)} but {_describe(key, other)}; "
                                 "give it in one place")
        _apply(config, key, winner[2])
    zero = config.setdefault("zero_optimization", {})
    if "stage" not in zero:
        # Accelerate's DeepSpeed default is stage 2; without any ZeRO setting it is plain DDP.
        chose_zero = bool(plugin or ds_yaml or code_json is not None)
        zero["stage"] = 2 if chose_zero else 0
    return config


def zero3_init_flag(plugin: DeepSpeedPlugin | None, launcher: AccelerateConfig | None) -> bool:
    """Accelerate's zero3_init_flag from the plugin, else the YAML."""
    if plugin is not None and plugin.zero3_init_flag is not None:
        return bool(plugin.zero3_init_flag)
    return bool(launcher is not None and launcher.deepspeed.get("zero3_init_flag"))


def _name(source) -> str:
    return f"DeepSpeed config {source}" if isinstance(source, (str, os.PathLike)) and \
        os.path.exists(source) else "the DeepSpeed config"


def _describe(key: str, entry) -> str:
    name, _, value = entry
    if name.startswith("Accelerator") or name.startswith("DeepSpeedPlugin"):
        return f"{name.split('(')[0]}({key}={value!r})"
    if name.startswith("accelerate config"):
        return f"{name} says {key}: {value!r}"
    return f"{name} has {SETTINGS.get(key, 'bf16/fp16.enabled')} = {value!r}"


def _int(value, key: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            return int(str(value))
        except ValueError:
            raise ValueError(f"accelerate config {path}: {key} = {value!r} is not a whole number") from None
    return value


def _convert(key: str, value):
    if key == "mixed_precision":
        return check_precision(value, f"mixed_precision={value!r}")
    if key == "zero_stage":
        if value not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={value!r}: ZeRO stages are 0, 1, 2, 3")
    if key.endswith("_device"):
        value = str(value).lower()
        if value not in ("none", "cpu", "nvme"):
            raise ValueError(f"{key}={value!r}: choose none, cpu or nvme")
    return value


def _current(config: dict, key: str):
    """The JSON's value for an Accelerate setting (None when absent or "auto")."""
    if key == "mixed_precision":
        fp16 = (config.get("fp16") or {}).get("enabled")
        bf16 = (config.get("bf16") or config.get("bfloat16") or {}).get("enabled")
        if "auto" in (fp16, bf16) or (fp16 is None and bf16 is None):
            return None
        return "fp16" if fp16 is True else "bf16" if bf16 is True else "no"
    node = config
    for part in SETTINGS[key].split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if node == "auto" else node


def _apply(config: dict, key: str, value) -> None:
    if key == "mixed_precision":
        for name in ("fp16", "bf16"):
            block = config.setdefault(name, {})
            block["enabled"] = value == name
        config.pop("bfloat16", None)
        return
    *parents, last = SETTINGS[key].split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
