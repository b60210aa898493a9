"""Where an Accelerator's ZeRO settings come from: the `accelerate config` YAML (read with
PyYAML, as accelerate reads it), DeepSpeedPlugin, Accelerator keywords and DeepSpeed JSON, with
what the script says winning over the launcher and same-origin disagreements named; `zeroshard
run --config_file` takes ranks and rendezvous from the YAML."""

from __future__ import annotations

import json

import pytest

from tests.test_accelerate import write_yaml
from zeroshard.cli import launch
from zeroshard.compat.accelerate.config import (ENV, DeepSpeedPlugin, build_deepspeed_config,
                                               read_accelerate_config)

# What `accelerate config` writes for a 2-node DeepSpeed job with a JSON config, plus comments.
FULL = """\
# written by accelerate config
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_config_file: {json}   # the whole DeepSpeed config
  deepspeed_multinode_launcher: standard
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
dynamo_config: {{}}
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 1
main_process_ip: 10.1.2.3
main_process_port: 29600
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
use_cpu: false
commands:
- echo
- "two words"
"""


def _build(arguments=None, plugin=None, deepspeed_config=None, launcher=None) -> dict:
    args = dict.fromkeys(["mixed_precision", "zero_stage", "gradient_accumulation_steps",
                          "offload_optimizer_device", "offload_param_device", "gradient_clipping"])
    args.update(arguments or {})
    return build_deepspeed_config(arguments=args, plugin=plugin, deepspeed_config=deepspeed_config,
                                  launcher=launcher)


def test_a_file_that_is_not_yaml_is_an_error_naming_it(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config: [unclosed\n")
    with pytest.raises(ValueError, match=r"acc\.yaml: not valid YAML"):
        read_accelerate_config(str(path))


def test_read_accelerate_config(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(FULL.format(json="ds.json"))
    cfg = read_accelerate_config(str(path))
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank) == (8, 2, 1)
    assert (cfg.main_process_ip, cfg.main_process_port, cfg.mixed_precision) == ("10.1.2.3", 29600, "bf16")
    assert cfg.deepspeed["zero3_init_flag"] is True and cfg.notices == []
    path.write_text("distributed_type: FSDP\n")
    with pytest.raises(ValueError, match="distributed_type: FSDP is not run by zeroshard"):
        read_accelerate_config(str(path))
    path.write_text("mixed_precision: fp8\n")
    with pytest.raises(ValueError, match="fp8 is not supported"):
        read_accelerate_config(str(path))
    path.write_text("mixed_precision: no\nnew_key: 1\ndeepspeed_config:\n  zero_stage: 1\n  other: 2\n")
    cfg = read_accelerate_config(str(path))
    assert cfg.mixed_precision == "no"  # YAML's bare no is False
    assert cfg.notices == [f"accelerate config {path}: new_key, deepspeed_config.other have no "
                           "effect in zeroshard"]


def test_defaults_follow_accelerate():
    """No ZeRO setting anywhere: plain data parallel (stage 0); a DeepSpeed plugin without a
    stage: Accelerate's default, stage 2."""
    assert _build()["zero_optimization"]["stage"] == 0
    assert _build(plugin=DeepSpeedPlugin())["zero_optimization"]["stage"] == 2


def test_settings_map_onto_deepspeed_keys():
    config = _build({"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "nvme",
                     "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
                     "mixed_precision": "bf16"},
                    plugin=DeepSpeedPlugin(offload_param_nvme_path="/nvme", zero3_save_16bit_model=True))
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"] == {"device": "cpu"}
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/nvme"}
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"]) == (4, 1.0)
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}


def test_script_wins_over_launcher_and_same_origin_conflicts_are_errors(tmp_path):
    launcher = read_accelerate_config(write_yaml(tmp_path / "acc.yaml", 3, "cpu"))
    config = _build({"zero_stage": 1}, launcher=launcher)
    assert config["zero_optimization"]["stage"] == 1  # the script said so
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # from the YAML
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}))
    with pytest.raises(ValueError, match=r"Accelerator\(zero_stage=3\) but DeepSpeed config .*ds.json"
                                         r" has zero_optimization.stage = 2; give it in one place"):
        _build({"zero_stage": 3}, deepspeed_config=str(ds))
    config = _build({"mixed_precision": "bf16"}, deepspeed_config=str(ds))
    assert config["bf16"]["enabled"] is True  # "auto" in the JSON is filled
    with pytest.raises(ValueError, match="DeepSpeedPlugin\\(zero_stage=1\\) but"):
        _build(plugin=DeepSpeedPlugin(zero_stage=1, hf_ds_config=str(ds)))
    both = tmp_path / "both.yaml"
    both.write_text(f"deepspeed_config:\n  deepspeed_config_file: {ds}\n  zero_stage: 3\n")
    with pytest.raises(ValueError, match="says zero_stage: 3 but DeepSpeed config"):
        _build(launcher=read_accelerate_config(str(both)))


def test_zeroshard_run_config_file_sets_ranks_and_rendezvous(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from zeroshard import Accelerator\n")
    acc = tmp_path / "acc.yaml"
    acc.write_text(FULL.format(json=tmp_path / "ds.json"))
    args = launch.prepare_run_args(["--config_file", str(acc), str(script)])
    assert (args.nproc_per_node, args.nnodes, args.node_rank) == ("4", "2", 1)
    assert (args.master_addr, args.master_port, args.standalone) == ("10.1.2.3", 29600, False)
    assert args.zeroshard_env[ENV] == str(acc)
    args = launch.prepare_run_args(["--config_file", write_yaml(tmp_path / "cpu.yaml", 2),
                                    "--nproc-per-node", "3", str(script)])
    assert args.nproc_per_node == "3"  # the command line wins
    assert args.zeroshard_env["CUDA_VISIBLE_DEVICES"] == "" and args.standalone  # use_cpu: true
