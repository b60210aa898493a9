"""A DeepSpeed tutorial script with `import zeroshard as deepspeed` runs unchanged under
`zeroshard script.py --deepspeed --deepspeed_config cfg.json` at 2 ranks, stages 0-3, and matches
a single-process reference; every DeepSpeed name it touches behaves (tests/dropin_script.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
import dropin_script  # noqa: E402

ROOT = Path(__file__).parent.parent
MICRO, CLIP, LR, WORLD = 4, 1.0, 0.01, 2


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _reference() -> dict[str, torch.Tensor]:
    """The same steps in one process: each global batch is the union of the ranks' batches."""
    torch.manual_seed(0)
    model = dropin_script.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = dropin_script.dataset()
    steps = 0
    for epoch in range(10):
        batches = []
        for rank in range(WORLD):
            sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            batches.append([idx[i:i + MICRO] for i in range(0, len(idx), MICRO)])
        for per_rank in zip(*batches):
            opt.zero_grad()
            loss = sum(F.mse_loss(model(data[i][0]), data[i][1]) for i in per_rank) / WORLD
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            steps += 1
            if steps == dropin_script.STEPS:
                return {n: p.detach() for n, p in model.named_parameters()}
    raise AssertionError("dataset too small for the steps")


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tutorial_script_runs_unchanged(stage, reference, tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(_config(stage)))
    env = dict(os.environ, ZEROSHARD_QUIET="1", PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-m", "zeroshard.cli", str(ROOT / "tests" / "dropin_script.py"),
                          "--deepspeed", "--deepspeed_config", str(cfg), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"stage {stage}: checks failed: {failed}"
    if stage == 3:
        assert "ds_attrs" in result["checks"]
    assert result["stage"] == stage
    for name, ref in reference.items():
        got = torch.tensor(result["weights"][name])
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"stage {stage} {name}: relative error {err:.2e}"


# -- initialize's argument shapes, zero.Init's DeepSpeed keywords, "auto" values ------------------

def _names(rank, world):
    import base64
    import datetime

    import zeroshard as deepspeed
    from zeroshard.config import ConfigError

    out = {}
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60),
                               distributed_port=29511, verbose=False)  # already up: a no-op
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="cpu", enabled=True):
        model = dropin_script.Net()
    out["init_partitioned"] = all(p.numel() < p.ds_numel or p.ds_numel <= 16
                                  for p in model.parameters())
    groups = [{"params": list(model.blocks.parameters()), "lr": 0.01},
              {"params": list(model.head.parameters()), "lr": 0.001}]
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, config=encoded,
        optimizer=lambda params: deepspeed.ops.adam.FusedAdam(params, lr=0.01),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    x = torch.randn(2, dropin_script.FEATURES)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    out["groups_and_scheduler"] = [g["lr"] for g in optimizer.param_groups] == [0.005, 0.0005]
    out["fused_adam"] = isinstance(optimizer.optimizer, deepspeed.ops.adam.FusedAdam)
    engine.destroy()
    # "auto": micro batch from a DataLoader, bucket sizes from the model's hidden size.
    model = dropin_script.Net()
    model.config = type("Config", (), {"hidden_size": 32})()
    loader = torch.utils.data.DataLoader(dropin_script.dataset(), batch_size=3)
    auto = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}
    engine, _, data, _ = deepspeed.initialize(model=model, config=auto, training_data=loader,
                                              optimizer=torch.optim.AdamW(model.parameters()))
    resolved = engine.config
    zero = resolved["zero_optimization"]
    out["auto"] = (resolved["train_micro_batch_size_per_gpu"], resolved["train_batch_size"],
                   resolved["gradient_clipping"], resolved["bf16"]["enabled"],
                   zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
                   zero["stage3_param_persistence_threshold"], data.batch_size)
    engine.destroy()
    try:
        deepspeed.initialize(model=dropin_script.Net(), config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
        out["unresolvable"] = "no error"
    except ConfigError as err:
        out["unresolvable"] = str(err)
    out["callers"] = _callers(rank)
    return out


def _callers(rank):
    """The DeepSpeed names Hugging Face, TRL and DeepSpeed-Chat use on an engine (stage 3)."""
    import io
    import warnings

    import zeroshard as deepspeed
    from zeroshard.compat.deepspeed.guards import PartitionedStateError, PartitionedStateWarning
    from tests.hf_assets import DS_ZERO3

    out = {}
    with deepspeed.zero.Init(config_dict_or_path=DS_ZERO3):  # "auto"s are left for later
        model = dropin_script.Net()
    out["init_auto"] = all(p.numel() == 0 for p in model.blocks.parameters())
    model.head.bias.requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    norms = {}
    for scale_wrt_gas in (True, False):
        torch.manual_seed(0)
        fresh = dropin_script.Net()
        engine, optimizer, _, _ = deepspeed.initialize(
            model=fresh, config=cfg, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.0))
        for _ in range(2):
            engine.backward(engine(torch.ones(2, dropin_script.FEATURES)).sum(),
                            scale_wrt_gas=scale_wrt_gas)
            engine.step()
        norms[scale_wrt_gas] = engine.get_global_grad_norm()
        engine.destroy()
    out["scale_wrt_gas"] = norms[False] / norms[True]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, config=cfg, optimizer=torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=0.01))
    for _ in range(2):
        engine.backward(engine(torch.randn(2, dropin_script.FEATURES)).pow(2).mean())
        engine.step()
    params = list(engine.module.parameters())
    offload = optimizer.parameter_offload
    out["ds_markers"] = (all(hasattr(p, "ds_id") and p.ds_active_sub_modules == set()
                             for p in params),
                         engine.module.blocks[0].ds_external_parameters() == [],
                         offload.module is engine.module, offload.forward_hooks == [],
                         callable(offload._register_deepspeed_module))
    engine.tput_timer.update_epoch_count()
    out["timer"] = (engine.tput_timer.epoch_count, engine.tput_timer.global_step_count,
                    engine.tput_timer.avg_samples_per_sec() > 0)
    out["overflow"] = optimizer.overflow
    whole = engine.consolidated_state_dict(rank0_only=False)
    weight = engine.module.blocks[0][0].weight
    with deepspeed.zero.GatheredParameters([weight, None]):  # transformers passes absent biases
        kept = weight.data.cpu()  # on the CPU this is the gathered buffer itself
    out["kept_after_exit"] = torch.equal(kept, whole["blocks.0.0.weight"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.module.state_dict()
    out["state_dict_warns"] = [str(w.message) for w in caught
                               if issubclass(w.category, PartitionedStateWarning)]
    try:
        torch.save(weight, io.BytesIO())
        out["pickle"] = "no error"
    except PartitionedStateError as err:
        out["pickle"] = str(err)
    try:
        optimizer.state_dict()
        out["optimizer_state_dict"] = "no error"
    except RuntimeError as err:
        out["optimizer_state_dict"] = str(err)
    without = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    out["exclude_frozen"] = sorted(set(whole) - set(without)) if rank == 0 else None
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def names():
    from tests.harness import run_world

    return run_world(2, _names)


def test_initialize_argument_shapes_and_init_keywords(names):
    for got in names:
        assert got["init_partitioned"] and got["groups_and_scheduler"] and got["fused_adam"]


def test_auto_values_resolve_as_documented(names):
    for got in names:
        # micro = the DataLoader's 3; total = 3 x 1 x 2 ranks; clipping 1.0; bf16 from an fp32
        # model: off; h = 32: h^2, 0.9 h^2, 10 h.
        assert got["auto"] == (3, 6, 1.0, False, 1024, 921, 320, 3)
        assert "optimizer.params.lr" in got["unresolvable"] and "auto" in got["unresolvable"]


def test_names_hugging_face_trl_and_deepspeed_chat_read(names):
    """zero.Init takes the HF "auto" config; backward(scale_wrt_gas=False) leaves the loss
    undivided (accelerate divides it); stage-3 markers TRL reads; tput_timer; overflow."""
    for got in names:
        c = got["callers"]
        assert c["init_auto"] and c["ds_markers"] == (True, True, True, True, True)
        assert c["scale_wrt_gas"] == pytest.approx(2.0, rel=1e-6)
        assert c["timer"] == (1, 1, True) and c["overflow"] is False  # 2 micro-steps, gas 2
    assert names[0]["callers"]["exclude_frozen"] == ["head.bias"]


def test_partitioned_parameters_are_never_saved_empty_without_a_word(names):
    """A tensor kept from inside GatheredParameters stays whole after it; state_dict() of a
    released model warns, torch.save of a released parameter and the sharded optimizer's
    state_dict() raise, each naming what to use instead."""
    for got in names:
        c = got["callers"]
        assert c["kept_after_exit"]
        assert len(c["state_dict_warns"]) == 1 and "GatheredParameters" in c["state_dict_warns"][0]
        assert "GatheredParameters" in c["pickle"] and "consolidated_state_dict" in c["pickle"]
        assert "save_checkpoint" in c["optimizer_state_dict"]


def test_deepspeed_utility_names():
    """utils.logger is a real Logger; clone_tensors_for_torch_save copies; z3 leaf marks make a
    module one stage-3 unit; the CPU Adagrad / Lion classes step."""
    import logging

    from torch import nn

    from zeroshard.checkpoint.clone import clone_tensors_for_torch_save
    from zeroshard.core.partition import unit_modules
    from zeroshard.compat.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from zeroshard.compat.deepspeed.ops.lion import DeepSpeedCPULion
    from zeroshard.compat.deepspeed.utils import logger, set_z3_leaf_modules, z3_leaf_module

    assert isinstance(logger, logging.Logger)
    base = torch.arange(6.0)
    copied = clone_tensors_for_torch_save({"a": [base[2:4]], "b": (1, base)})
    assert torch.equal(copied["a"][0], base[2:4]) and copied["b"][0] == 1
    assert copied["a"][0].untyped_storage().nbytes() == 2 * 4  # its own bytes, not the buffer's
    model = dropin_script.Net()
    assert [n for n, _ in unit_modules(model)] == ["blocks.0", "blocks.1"]
    set_z3_leaf_modules(model, [nn.Linear])  # the head was no unit of its own
    assert z3_leaf_module(model.head)
    assert [n for n, _ in unit_modules(model)] == ["blocks.0", "blocks.1", "head"]
    with pytest.raises(ValueError, match="no module of class"):
        set_z3_leaf_modules(model, ["NoSuchBlock"])
    for cls in (DeepSpeedCPUAdagrad, DeepSpeedCPULion):
        p = nn.Parameter(torch.ones(3))
        opt = cls([p], lr=0.1)
        p.grad = torch.ones(3)
        opt.step()
        assert (p < 1).all(), cls.__name__
