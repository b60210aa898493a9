"""`from zeroshard import Accelerator`: the seed's Accelerate loop, verbatim except the import,
at stages 1-3 and with CPU offload (ZeRO settings from an `accelerate config` YAML, from
Accelerator arguments, from a DeepSpeed JSON config) equals a single-process reference; an
Accelerate-docs-style loop with accumulate(), clipping, a scheduler and save_state/load_state
resumes exactly; the rest of the surface behaves. The seed loop with the real `accelerate`
under `zeroshard run` is in test_hf_stack.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.accelerate_seed_loop import BATCH, fresh, seed_loop, weights
from tests.harness import run_world

ROOT = Path(__file__).parent.parent
WORLD = 2
YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: {gas}
  offload_optimizer_device: {offload}
  offload_param_device: {offload_param}
  zero3_init_flag: false
  zero3_save_16bit_model: false
  zero_stage: {stage}
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: {world}
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""
# (stage, optimizer offload, parameter offload, accumulation) set through the YAML.
YAML_RUNS = [(1, "none", "none", 1), (2, "none", "none", 1), (3, "none", "none", 1),
             (3, "cpu", "cpu", 1), (2, "cpu", "none", 2)]


def write_yaml(path, stage, offload="none", offload_param="none", gas=1, world=WORLD) -> str:
    Path(path).write_text(YAML.format(stage=stage, offload=offload, offload_param=offload_param,
                                      gas=gas, world=world))
    return str(path)


def reference(gas: int = 1, clip: float = 0.0) -> dict[str, torch.Tensor]:
    """One process: step k takes the original batches k*N*gas .. (k+1)*N*gas - 1 at once."""
    model, optimizer, loader = fresh()
    batches = list(loader)
    per_step = WORLD * gas
    for k in range(len(batches) // per_step):
        group = batches[k * per_step:(k + 1) * per_step]
        optimizer.zero_grad()
        merged = {key: torch.cat([b[key] for b in group]) for key in group[0]}
        model(**merged).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {f"lm.{n}" if not n.startswith("lm.") else n: p.detach().clone()
            for n, p in model.named_parameters()}


def _worst(got: dict, ref: dict) -> float:
    return max(((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)


def _seed_runs(rank, world, tmp):
    from zeroshard import Accelerator, DeepSpeedPlugin
    from zeroshard.compat.accelerate.config import ENV

    out = {}
    for stage, offload, offload_param, gas in YAML_RUNS:
        os.environ[ENV] = write_yaml(os.path.join(tmp, f"acc{rank}.yaml"), stage, offload,
                                     offload_param, gas)
        accelerator, engine = seed_loop(*fresh())
        out[("yaml", stage, offload, gas)] = (weights(accelerator, engine),
                                              engine.zero_optimization_stage(),
                                              engine.memory_report()["optimizer"]["cpu"])
        engine.destroy()
    del os.environ[ENV]
    # Arguments and a DeepSpeed JSON config (with clipping) instead of the YAML.
    for kind in ("arguments", "plugin", "json"):
        model, optimizer, loader = fresh()
        if kind == "arguments":
            accelerator = Accelerator(zero_stage=3, offload_optimizer_device="cpu",
                                      gradient_accumulation_steps=2)
        elif kind == "plugin":
            accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2,
                                                                       gradient_clipping=0.05))
        else:
            path = os.path.join(tmp, f"ds{rank}.json")
            with open(path, "w") as fh:
                json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.05,
                           "zero_optimization": {"stage": 1}}, fh)
            accelerator = Accelerator(deepspeed_config=path)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for batch in loader:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
        out[kind] = (weights(accelerator, model), model.zero_optimization_stage(),
                     model.train_micro_batch_size_per_gpu())
        model.destroy()
    return out


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory):
    return run_world(WORLD, _seed_runs, str(tmp_path_factory.mktemp("acc")))[0]


@pytest.mark.parametrize("stage,offload,offload_param,gas", YAML_RUNS)
def test_seed_loop_from_accelerate_yaml_equals_reference(seed_runs, stage, offload, offload_param, gas):
    got, ran_stage, cpu_optimizer_bytes = seed_runs[("yaml", stage, offload, gas)]
    assert ran_stage == stage
    assert (cpu_optimizer_bytes > 0) == (offload == "cpu")
    # No gradient_clipping in the YAML: accelerate leaves the key out, so DeepSpeed's default
    # (1.0 since 0.19.3) clips.
    assert _worst(got, reference(gas, clip=1.0)) < 1e-5


@pytest.mark.parametrize("kind,stage,gas,clip", [("arguments", 3, 2, 1.0), ("plugin", 2, 1, 0.05),
                                                  ("json", 1, 1, 0.05)])
def test_seed_loop_from_arguments_plugin_and_json(seed_runs, kind, stage, gas, clip):
    got, ran_stage, micro = seed_runs[kind]
    assert (ran_stage, micro) == (stage, BATCH)  # "auto" micro batch: the loader's batch size
    assert _worst(got, reference(gas, clip)) < 1e-5
