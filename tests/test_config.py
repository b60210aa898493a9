"""Tests for zeroshard.config: seeds load, the batch-size rule, errors, warnings, round trips."""

import glob
import json
import os
import pathlib
import sys
import warnings

import pytest
import torch

from zeroshard.config import (
    ConfigError,
    ConfigWarning,
    NotSupportedYetError,
    ZeroConfig,
    load_config,
    require_supported,
)

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples" / "configs"
SEEDS = sorted(glob.glob(str(CONFIG_DIR / "*.json")))


def load_quietly(config, world_size=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(config, world_size=world_size)


def load_recording(config, world_size=1):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config, world_size=world_size)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# ------------------------------------------------------------------------------------------------
# Seed configs


def test_seed_configs_exist():
    assert len(SEEDS) >= 7


def _needs_unsupported(raw: dict) -> bool:
    zero = raw.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {})
    return zero.get("stage", 0) > 0 and offload.get("device", "none") in ("cpu", "nvme") and \
        offload.get("ratio", 1.0) < 1.0


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("path", SEEDS, ids=[os.path.basename(p) for p in SEEDS])
def test_seed_loads(path, world_size):
    cfg = load_quietly(path, world_size=world_size)
    raw = json.loads(pathlib.Path(path).read_text())
    assert cfg.train_batch_size == (
        cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world_size)
    assert cfg.zero_optimization.stage == raw["zero_optimization"]["stage"]
    if _needs_unsupported(raw):
        with pytest.raises(NotSupportedYetError) as err:
            require_supported(cfg)
        assert str(err.value).startswith("not supported yet:")
    else:
        require_supported(cfg)


def test_seed_offload_param_stage2_warns():
    cfg, messages = load_recording(CONFIG_DIR / "seed_offload_param_stage2.json")
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert any("offload_param only applies to ZeRO stage 3; ignored at stage 2" in m
               for m in messages)


def test_seed_stage2_bucket_sizes_are_ints():
    cfg = load_quietly(CONFIG_DIR / "seed_stage2.json")
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert type(cfg.zero_optimization.allgather_bucket_size) is int


def test_seed_stage3_offload_is_supported():
    cfg = load_quietly(CONFIG_DIR / "seed_stage3_offload.json")
    zero = cfg.zero_optimization
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_param.device) == (3, "cpu", "cpu")
    assert (zero.offload_optimizer.ratio, zero.offload_optimizer.pin_memory) == (1.0, True)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (16, 16, 1)
    assert (cfg.optimizer.type, cfg.optimizer.params) == ("Adam", {"lr": 1e-5})
    require_supported(cfg)  # raises NotSupportedYetError when it is not


def test_partial_offload_ratio_is_refused_by_name():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    with pytest.raises(NotSupportedYetError, match=r"offload_optimizer\.ratio=0\.3"):
        require_supported(cfg)


def test_stage3_without_offload_is_supported():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3}})
    zero = cfg.zero_optimization
    assert (zero.stage, zero.offload_optimizer, zero.offload_param) == (3, None, None)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (4, 4, 1)
    require_supported(cfg)  # raises NotSupportedYetError when it is not


# ------------------------------------------------------------------------------------------------
# Batch-size rule: train_batch_size = micro * accumulation * world_size


def rule(given: dict, w: int):
    """Expected (tbs, micro, gas) from DeepSpeed's rule, or None when the values cannot fit."""
    t, m, g = given.get("t"), given.get("m"), given.get("g")
    if t is not None and m is not None and g is not None:
        return (t, m, g) if t == m * g * w else None
    if t is not None:
        if m is None and g is None:
            m, g = None, 1
        divisor = (m if m is not None else g) * w
        if t % divisor:
            return None
        return (t, m, t // divisor) if m is not None else (t, t // divisor, g)
    m = 1 if m is None else m
    g = 1 if g is None else g
    return (m * g * w, m, g)


BATCH_CASES = [
    {"t": 24}, {"t": 18}, {"m": 3}, {"g": 4},
    {"t": 24, "m": 2}, {"t": 24, "m": 3}, {"t": 12, "m": 5},
    {"t": 24, "g": 4}, {"t": 12, "g": 2}, {"t": 36, "g": 3},
    {"m": 2, "g": 3},
    {"t": 6, "m": 2, "g": 3}, {"t": 12, "m": 2, "g": 3}, {"t": 18, "m": 2, "g": 3},
    {"t": 24, "m": 2, "g": 3}, {"t": 25, "m": 2, "g": 3},
]
KEYS = {"t": "train_batch_size", "m": "train_micro_batch_size_per_gpu",
        "g": "gradient_accumulation_steps"}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("given", BATCH_CASES,
                         ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_batch_rule(given, world_size):
    config = {KEYS[k]: v for k, v in given.items()}
    expected = rule(given, world_size)
    if expected is None:
        with pytest.raises(ConfigError) as err:
            load_config(config, world_size=world_size)
        msg = str(err.value)
        assert f"world_size={world_size}" in msg
        for k, v in given.items():
            assert f"{KEYS[k]}={v}" in msg
        return
    cfg = load_config(config, world_size=world_size)
    got = (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
           cfg.gradient_accumulation_steps)
    assert got == expected
    assert got[0] == got[1] * got[2] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_batch_contradiction_names_all_values(world_size):
    t, m, g = 7 * world_size + 1, 2, 3
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": t, "train_micro_batch_size_per_gpu": m,
                     "gradient_accumulation_steps": g}, world_size=world_size)
    msg = str(err.value)
    for text in (f"train_batch_size={t}", f"train_micro_batch_size_per_gpu={m}",
                 f"gradient_accumulation_steps={g}", f"world_size={world_size}"):
        assert text in msg


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_batch_none_given_notice(world_size):
    with pytest.warns(ConfigWarning, match="batch size"):
        cfg = load_config({}, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (world_size, 1, 1)


@pytest.mark.parametrize("world_size", [0, -1, 1.0, True])
def test_bad_world_size(world_size):
    with pytest.raises(ConfigError, match="world_size"):
        load_config({"train_batch_size": 4}, world_size=world_size)


# ------------------------------------------------------------------------------------------------
# Malformed configs: (config, substrings the message must contain)

BAD = [
    ({"train_batch_sise": 8}, ["train_batch_sise", "train_batch_size"]),
    ({"zero_optimisation": {"stage": 1}}, ["zero_optimisation", "zero_optimization"]),
    ({"zero_optimization": {"reduce_buket_size": 1}},
     ["zero_optimization.reduce_buket_size", "reduce_bucket_size"]),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"devise": "cpu"}}},
     ["zero_optimization.offload_optimizer.devise", "'device'"]),
    ({"fp16": {"enabeld": True}}, ["fp16.enabeld", "'enabled'"]),
    ({"tensorbord": {"enabled": True}}, ["tensorbord", "tensorboard"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "4"]),
    ({"zero_optimization": {"stage": -1}}, ["zero_optimization.stage", "-1"]),
    ({"zero_optimization": {"stage": "two"}}, ["zero_optimization.stage", "two"]),
    ({"zero_optimization": {"stage": 1.5}}, ["zero_optimization.stage", "1.5"]),
    ({"gradient_clipping": -1.0}, ["gradient_clipping", "-1.0"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16", "bf16"]),
    ({"zero_optimization": {"reduce_bucket_size": 2.5}},
     ["zero_optimization.reduce_bucket_size", "2.5"]),
    ({"zero_optimization": {"allgather_bucket_size": -1}},
     ["zero_optimization.allgather_bucket_size", "-1"]),
    ({"zero_optimization": {"reduce_bucket_size": "2e8"}},
     ["zero_optimization.reduce_bucket_size", "2e8"]),
    ({"zero_optimization": {"overlap_comm": "yes"}}, ["zero_optimization.overlap_comm", "yes"]),
    ({"fp16": {"enabled": "true"}}, ["fp16.enabled", "true"]),
    ({"bf16": {"enabled": 1}}, ["bf16.enabled", "1"]),
    ({"steps_per_print": True}, ["steps_per_print", "true"]),
    ({"optimizer": {"type": "Adamm"}}, ["optimizer.type", "Adamm", "'Adam'"]),
    ({"optimizer": {"type": "SGDD", "params": {}}}, ["optimizer.type", "SGDD", "'SGD'"]),
    ({"optimizer": {"params": {"lr": 1e-3}}}, ["optimizer.type", "missing"]),
    ({"optimizer": {"type": "Adam", "params": [1e-3]}}, ["optimizer.params", "JSON object"]),
    ({"optimizer": "Adam"}, ["optimizer", "JSON object"]),
    ({"scheduler": {"type": "WarmupCosine"}}, ["scheduler.type", "WarmupCosine", "WarmupCosineLR"]),
    ({"scheduler": {"type": "StepLR"}}, ["scheduler.type", "StepLR", "WarmupLR"]),
    ({"optimizer": {"type": "RMSprop"}}, ["optimizer.type", "RMSprop", "known: Adam"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     ["zero_optimization.offload_optimizer.device", "gpu", "'cpu'"]),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     ["zero_optimization.offload_param", "nvme_path"]),
    ({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}},
     ["zero_optimization.offload_optimizer.ratio", "1.5"]),
    ({"zero_optimization": "stage2"}, ["zero_optimization", "JSON object"]),
    ({"train_batch_size": "auto"}, ["train_batch_size", "auto", "Hugging Face"]),
    ({"gradient_accumulation_steps": "auto"}, ["gradient_accumulation_steps", "Hugging Face"]),
    ({"train_micro_batch_size_per_gpu": 0}, ["train_micro_batch_size_per_gpu", "0"]),
    ({"gradient_accumulation_steps": 1.5}, ["gradient_accumulation_steps", "1.5"]),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ["fp16.min_loss_scale", "0"]),
    ({"aio": {"queue_depth": 0}}, ["aio.queue_depth", "0"]),
    ({"communication_data_type": "fp64"}, ["communication_data_type", "fp64"]),
    ({"zero_optimization": {"zeroshard_unit_classes": "GPT2Block"}},
     ["zero_optimization.zeroshard_unit_classes", "GPT2Block"]),
    ({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1e7,
                            "stage3_prefetch_bucket_size": 2e7}},
     ["prefetch_bucket_size", "stage3_prefetch_bucket_size"]),
    ({"zero_optimization": {"cpu_offload": True,
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
     ["cpu_offload", "nvme"]),
    # optimizer.params: checked for every type the engine builds from a config
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
     ["optimizer.params.betas", "[0.9]", "two numbers"]),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99, 0.999]}}},
     ["optimizer.params.betas", "[0.9, 0.99, 0.999]"]),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
     ["optimizer.params.betas", "[0, 1)"]),
    ({"optimizer": {"type": "Adam", "params": {"lr": "1e-3"}}},
     ["optimizer.params.lr", '"1e-3"', "expected a number"]),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, ["optimizer.params.lr", "-1"]),
    ({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}},
     ["optimizer.params.lr", "auto", "initialize"]),
    ({"optimizer": {"type": "Adam", "params": {"eps": -1e-8}}}, ["optimizer.params.eps", "-1e-08"]),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": "0.01"}}},
     ["optimizer.params.weight_decay", '"0.01"']),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": "yes"}}},
     ["optimizer.params.amsgrad", '"yes"']),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}},
     ["optimizer.params.bias_correction", "false"]),
    ({"optimizer": {"type": "Adam", "params": {"learning_rate": 1e-3}}},
     ["optimizer.params.learning_rate", "Adam", "valid keys", "betas"]),
    ({"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.99]}}},
     ["optimizer.params.beta", "'betas'"]),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": -0.9}}},
     ["optimizer.params.momentum", "-0.9"]),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}},
     ["optimizer.params.nesterov", "momentum"]),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}},
     ["optimizer.params.betas", "SGD"]),
    ({"optimizer": {"type": "Adagrad", "params": {"lr_decay": -1}}},
     ["optimizer.params.lr_decay", "-1"]),
    ({"optimizer": {"type": "Adagrad", "params": {"initial_accumulator_value": [0]}}},
     ["optimizer.params.initial_accumulator_value", "[0]"]),
]


@pytest.mark.parametrize("config,expected", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_malformed_config(config, expected):
    with pytest.raises(ConfigError) as err:
        load_quietly(config)
    msg = str(err.value)
    for text in expected:
        assert text in msg, f"{text!r} not in {msg!r}"
    # pydantic's own wording and exception must never reach the user.
    assert "validation error" not in msg.lower() and "pydantic" not in msg.lower()
    assert err.value.__cause__ is None and err.value.__context__ is None


def test_every_optimizer_problem_in_one_error():
    with pytest.raises(ConfigError) as err:
        load_config({"optimizer": {"type": "Adam", "params": {"lr": "1e-3", "betas": [0.9],
                                                              "epsilon": 1e-8}}})
    msg = str(err.value)
    assert "3 problems" in msg
    for text in ("optimizer.params.lr", "optimizer.params.betas", "optimizer.params.epsilon"):
        assert text in msg


@pytest.mark.parametrize("kind,params", [
    ("Adam", {"lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1,
              "amsgrad": True, "bias_correction": True, "adam_w_mode": False, "torch_adam": True}),
    ("AdamW", {"lr": 0, "betas": (0.0, 0.5), "weight_decay": 0}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": 0, "nesterov": True, "weight_decay": 1e-4}),
    ("Adagrad", {"lr": 0.01, "lr_decay": 0.0, "eps": 1e-10, "initial_accumulator_value": 0.1}),
])
def test_valid_optimizer_params_build(kind, params):
    from zeroshard.core.optim import build_optimizer

    cfg = load_quietly({"optimizer": {"type": kind, "params": params}})
    built = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(2))])
    group = built.param_groups[0]
    for key, value in params.items():
        if key in group:
            assert group[key] == (tuple(value) if isinstance(value, list) else value), key


def test_all_bad_keys_in_one_error():
    config = {"train_batch_sise": 8, "fp16": {"enabeld": True},
              "zero_optimization": {"stage": 9, "reduce_buket_size": 1}}
    with pytest.raises(ConfigError) as err:
        load_config(config)
    msg = str(err.value)
    for text in ("train_batch_sise", "fp16.enabeld", "zero_optimization.reduce_buket_size",
                 "zero_optimization.stage"):
        assert text in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(path)
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(str(path))


def test_invalid_json_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,,}')
    with pytest.raises(ConfigError, match="broken.json") as err:
        load_config(path)
    assert "JSON" in str(err.value)


def test_json_file_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="list.json"):
        load_config(path)


@pytest.mark.parametrize("config", [[1, 2], 3, b"{}"])
def test_config_of_wrong_type(config):
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(config)


# ------------------------------------------------------------------------------------------------
# Accepted values, aliases, canonical names


def test_none_gives_defaults():
    with pytest.warns(ConfigWarning):
        cfg = load_config(None)
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000
    assert zero.stage3_model_persistence_threshold == sys.maxsize
    assert cfg.fp16.enabled is False and cfg.fp16.initial_scale_power == 16
    assert cfg.optimizer is None and cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.3+
    require_supported(cfg)


def test_float_sizes_become_ints():
    cfg = load_config({"train_batch_size": 8.0, "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 2e8, "allgather_bucket_size": 5e8}})
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int
    assert cfg.train_batch_size == 8 and type(cfg.train_batch_size) is int


@pytest.mark.parametrize("given,canonical", [
    ("adamw", "AdamW"), ("Adamw", "AdamW"), ("ADAM", "Adam"), ("sgd", "SGD"),
    ("onebitadam", "OneBitAdam"), ("lion", "Lion"), ("musgd", "MuSGD")])
def test_optimizer_names(given, canonical):
    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": given, "params": {"lr": 1}}})
    assert cfg.optimizer.type == canonical and cfg.optimizer.params == {"lr": 1}


def test_scheduler_name_case_insensitive():
    cfg = load_config({"train_batch_size": 2, "scheduler": {"type": "warmupcosinelr"}})
    assert cfg.scheduler.type == "WarmupCosineLR" and cfg.scheduler.params == {}


def test_stage3_aliases_map_to_stage3_fields():
    cfg, messages = load_recording({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "prefetch_bucket_size": 1e7, "max_live_parameters": 3e8,
        "stage3_gather_fp16_weights_on_model_save": True}})
    zero = cfg.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 10_000_000
    assert zero.stage3_max_live_parameters == 300_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert messages == []


def test_bfloat16_alias():
    cfg = load_config({"train_batch_size": 2, "bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled


def test_legacy_cpu_offload_maps_and_warns():
    with pytest.warns(ConfigWarning, match="cpu_offload"):
        cfg = load_config({"train_batch_size": 2,
                           "zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_legacy_cpu_offload_param_maps_and_warns():
    """DeepSpeed's deprecated cpu_offload_param (singular) means offload_param.device cpu."""
    with pytest.warns(ConfigWarning, match="cpu_offload_param"):
        cfg = load_config({"train_batch_size": 2,
                           "zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert cfg.zero_optimization.offload_param.device == "cpu"
    with pytest.raises(ConfigError, match="contradicts offload_param.device='nvme'"):
        load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 3, "cpu_offload_param": True,
            "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})


def test_unit_classes():
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "zeroshard_unit_classes": ["GPT2Block"]}})
    assert cfg.zero_optimization.zeroshard_unit_classes == ["GPT2Block"]


# ------------------------------------------------------------------------------------------------
# Warnings for keys that do nothing here

INERT = [
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ({"elasticity": {"enabled": True}}, "elasticity"),
    ({"pipeline": {"stages": "auto"}}, "pipeline"),
    ({"amp": {"enabled": True}}, "amp"),
    ({"checkpoint": {"tag_validation": "Warn"}}, "checkpoint.tag_validation"),
    ({"checkpoint": {"tag_validation": "fail", "load_universal": False}},
     "checkpoint.load_universal"),
    ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9}},
     "zero_optimization.stage3_max_live_parameters"),
    ({"zero_optimization": {"stage": 1, "stage3_gather_16bit_weights_on_model_save": True}},
     "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
    ({"zero_optimization": {"stage": 2, "max_reuse_distance": 5}},
     "zero_optimization.stage3_max_reuse_distance"),
    ({"zero_optimization": {"stage": 2, "round_robin_gradients": True}},
     "zero_optimization.round_robin_gradients"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights"),
    ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
     "zero_optimization.zero_quantized_gradients"),
    # Accepted at stage 3 but not implemented there.
    ({"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 1e6}},
     "zero_optimization.stage3_model_persistence_threshold"),
    ({"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 100}},
     "zero_optimization.stage3_module_granularity_threshold"),
    ({"zero_optimization": {"stage": 3, "use_all_reduce_for_fetch_params": True}},
     "zero_optimization.stage3_use_all_reduce_for_fetch_params"),
    ({"zero_optimization": {"stage": 3, "memory_efficient_linear": False}},
     "zero_optimization.memory_efficient_linear"),
    ({"zero_optimization": {"stage": 2, "legacy_stage1": False}},
     "zero_optimization.legacy_stage1"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}},
     "zero_optimization.reduce_scatter"),
    ({"zero_optimization": {"stage": 1, "allgather_partitions": False}},
     "zero_optimization.allgather_partitions"),
    ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}},
     "zero_optimization.contiguous_gradients"),
]


@pytest.mark.parametrize("config,key", INERT, ids=[k for _, k in INERT])
def test_inert_key_warns_once(config, key):
    cfg, messages = load_recording({"train_batch_size": 4, **config})
    naming = [m for m in messages if key in m]
    assert len(naming) == 1, messages
    assert "\n" not in naming[0]
    assert "no effect" in naming[0] or "ignored" in naming[0]
    assert isinstance(cfg, ZeroConfig)


def test_notice_is_printed_once_as_one_line_by_rank_0_only():
    """What a user sees: loading the same config twice (Init, then initialize) prints each notice
    once, as one line without a source line echoed, and only on rank 0."""
    import subprocess

    code = ("import zeroshard\n"
            "for _ in range(2):\n"
            "    zeroshard.load_config({'train_batch_size': 2, 'elasticity': {'enabled': True}})\n")
    printed = {}
    for rank in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        res = subprocess.run([sys.executable, "-c", code], env=dict(env, RANK=rank),
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        printed[rank] = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(printed["0"]) == 1, printed["0"]
    assert "ConfigWarning: elasticity has no effect" in printed["0"][0]
    assert printed["1"] == []


def test_clean_config_does_not_warn():
    cfg, messages = load_recording({
        "train_batch_size": 8, "gradient_clipping": 1.0, "fp16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9,
                              "round_robin_gradients": False, "mics_shard_size": -1}})
    assert messages == []
    zero = cfg.zero_optimization
    assert (cfg.train_batch_size, cfg.gradient_clipping, cfg.fp16.enabled) == (8, 1.0, True)
    assert (cfg.optimizer.type, cfg.optimizer.params) == ("AdamW", {"lr": 1e-4})
    assert (zero.stage, zero.round_robin_gradients, zero.mics_shard_size) == (3, False, -1)
    assert zero.stage3_max_live_parameters == 1_000_000_000
    assert type(zero.stage3_max_live_parameters) is int  # 1e9 in JSON is a float


def test_checkpoint_tag_validation_modes():
    # DeepSpeed's three modes in any case; "fail" (what zeroshard does) is silent; others refused.
    cfg, messages = load_recording({"train_batch_size": 4, "checkpoint": {"tag_validation": "FAIL"}})
    assert cfg.checkpoint.tag_validation == "fail" and messages == []
    assert load_quietly({"train_batch_size": 4}).checkpoint.tag_validation == "warn"
    with pytest.raises(ConfigError, match=r"checkpoint\.tag_validation.*'ignore', 'warn', 'fail'"):
        load_config({"train_batch_size": 4, "checkpoint": {"tag_validation": "foo"}})


def test_inert_top_level_key_is_dropped():
    cfg = load_quietly({"train_batch_size": 4, "elasticity": {"enabled": True}})
    assert "elasticity" not in cfg.to_dict()


def test_stage0_offload_is_ignored_not_refused():
    cfg, messages = load_recording({"train_batch_size": 4, "zero_optimization": {
        "stage": 0, "offload_optimizer": {"device": "cpu"}}})
    # Parsed as given and not refused; the one warning says it has no effect at stage 0.
    assert (cfg.zero_optimization.stage, cfg.zero_optimization.offload_optimizer.device) == \
        (0, "cpu")
    require_supported(cfg)  # raises NotSupportedYetError when it is not
    assert len(messages) == 1 and "offload_optimizer" in messages[0] and \
        "ignored at stage 0" in messages[0]


def test_require_supported_nvme_offload():
    cfg = load_config({"train_batch_size": 4, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/nvme"}}})
    offload = cfg.zero_optimization.offload_optimizer
    assert (offload.device, offload.nvme_path) == ("nvme", "/tmp/nvme")
    assert require_supported(cfg) is None


# ------------------------------------------------------------------------------------------------
# Round trip


ROUND_TRIP = [
    {"train_batch_size": 16, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}},
     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
     "fp16": {"enabled": True, "loss_scale_window": 500}, "gradient_clipping": 1.0,
     "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True}},
    {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
     "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1e6,
                           "zeroshard_unit_classes": ["Block"],
                           "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("config", ROUND_TRIP + SEEDS, ids=lambda c: os.path.basename(c)
                         if isinstance(c, str) else "dict")
def test_to_dict_round_trip(config, world_size):
    cfg = load_quietly(config, world_size=world_size)
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    again, messages = load_recording(data, world_size=world_size)
    assert again.to_dict() == data
    assert again == cfg
    # Reloading must not produce notices the first load did not (e.g. about defaults).
    _, first = load_recording(config, world_size=world_size)
    assert set(messages) <= set(first)
