"""Config forms DeepSpeed accepts that DeepSpeed's examples and tutorial use: the deprecated
`"zero_optimization": true/false`, bf16 master weights / optimizer state, fp16-only keys that say
something only when fp16 is on, and the torch_autocast block."""

import re

import pytest

from tests.test_config import load_quietly, load_recording
from zeroshard.config import ConfigError, NotSupportedYetError, load_config, require_supported

# DeepSpeed's getting-started tutorial config, as printed there.
TUTORIAL = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "fp16": {"enabled": True}, "zero_optimization": True}
# DeepSpeedExamples' training/bf16_master_weight/configs/bf16_full.json.
BF16_FULL = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "steps_per_print": 100,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999],
                                                        "eps": 1e-8, "weight_decay": 0.01}},
             "bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                      "bf16_optimizer_states": True},
             "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                   "reduce_bucket_size": 5e7,
                                   "stage3_param_persistence_threshold": 0},
             "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}


@pytest.mark.parametrize("switch,stage", [(True, 1), (False, 0)])
def test_zero_optimization_switch_is_a_stage(switch, stage):
    """`"zero_optimization": true/false` is DeepSpeed's deprecated stage 1 / stage 0, with one
    notice saying what to write instead (top-level allgather_size goes along, as in DeepSpeed)."""
    cfg, messages = load_recording({**TUTORIAL, "zero_optimization": switch, "allgather_size": 4e7})
    assert cfg.zero_optimization.stage == stage
    if stage:
        assert cfg.zero_optimization.allgather_bucket_size == 40_000_000
    assert messages == [f'"zero_optimization": {str(switch).lower()} is DeepSpeed\'s deprecated '
                        f'form; read as stage {stage} (write "zero_optimization": '
                        f'{{"stage": {stage}}})']
    require_supported(cfg)
    assert load_quietly(cfg.to_dict()) == cfg


def test_tutorial_config_is_not_mutated():
    raw = dict(TUTORIAL)
    load_quietly(raw)
    assert raw == TUTORIAL


def test_bf16_master_weight_example_config_loads_silently():
    cfg, messages = load_recording(BF16_FULL)
    require_supported(cfg)
    assert messages == []
    assert cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
    assert (cfg.torch_autocast.enabled, cfg.torch_autocast.dtype) == (True, "bfloat16")
    again, messages = load_recording(cfg.to_dict())
    assert again == cfg and messages == []


@pytest.mark.parametrize("bf16,zero,error", [
    ({"bf16_optimizer_states": True}, {"stage": 2}, (ConfigError, "needs bf16_master_weights_and_grads")),
    ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {"stage": 0},
     (ConfigError, "needs ZeRO stage 1-3")),
    ({"bf16_master_weights_and_grads": True}, {"stage": 2},
     (NotSupportedYetError, "Set bf16.bf16_optimizer_states=true as well")),
    ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
     {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
     (NotSupportedYetError, "offload_optimizer.device='nvme'")),
])
def test_bf16_master_key_errors_name_the_keys(bf16, zero, error):
    kind, text = error
    with pytest.raises(kind, match=re.escape(text)):
        require_supported(load_quietly({"train_batch_size": 2, "bf16": {"enabled": True, **bf16},
                                        "zero_optimization": zero}))


def test_fp16_only_keys_are_quiet_when_fp16_is_off():
    """DeepSpeed's CIFAR-10 example writes fp16.fp16_master_weights_and_grads: false (and the bf16
    example bf16 keys) whichever precision it runs: no notice unless the key would matter."""
    off = {"enabled": False, "fp16_master_weights_and_grads": True, "auto_cast": True}
    assert load_recording({"train_batch_size": 2, "fp16": off})[1] == []
    assert load_recording({"train_batch_size": 2, "bf16": {"enabled": True},
                           "fp16": {"enabled": False, "fp16_master_weights_and_grads": False}})[1] == []
    _, messages = load_recording({"train_batch_size": 2,
                                  "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}})
    assert len(messages) == 1 and "fp16.fp16_master_weights_and_grads=true has no effect" in messages[0]


def test_torch_autocast_block():
    """dtype in any of DeepSpeed's spellings; float16 and lower_precision_safe_modules say what
    they do here; an unknown dtype is an error naming the key."""
    for spelling in ("bfloat16", "torch.bfloat16", "bf16"):
        cfg = load_quietly({"train_batch_size": 2, "torch_autocast": {"enabled": True, "dtype": spelling}})
        assert cfg.torch_autocast.dtype == "bfloat16"
    _, messages = load_recording({"train_batch_size": 2, "torch_autocast": {
        "enabled": True, "dtype": "half", "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert any("torch_autocast.lower_precision_safe_modules has no effect" in m for m in messages)
    assert any("torch_autocast.dtype=float16" in m and "loss scaling" in m for m in messages)
    with pytest.raises(ConfigError, match=r"torch_autocast\.dtype = \"fp32\""):
        load_config({"train_batch_size": 2, "torch_autocast": {"enabled": True, "dtype": "fp32"}})
