"""The DeepSpeed-shaped API: initialize() arguments and return values, engine accessors, errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n):
        self.data = make_batches(1, n)[0]

    def __len__(self):
        return self.data[0].shape[0]

    def __getitem__(self, i):
        return self.data[0][i], self.data[1][i]


def _expect_error(fn, kind=Exception) -> str:
    try:
        fn()
    except kind as err:  # noqa: PERF203
        return f"{type(err).__name__}: {err}"
    return "no error"


def _api(rank, world, config_path):
    out = {}
    # args.deepspeed_config is read when config= is absent; add_config_arguments adds the flags.
    parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    model = make_model()
    engine, optimizer, loader, sched = zeroshard.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=_Pairs(16))
    out["types"] = (type(engine).__name__, type(optimizer).__name__, type(loader).__name__,
                    type(sched).__name__)
    out["batch"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
                    engine.gradient_accumulation_steps())
    out["stage"] = engine.zero_optimization_stage()
    out["module_is_model"] = engine.module is model
    out["names_unchanged"] = [n for n, _ in model.named_parameters()] == \
        [n for n, _ in make_model().named_parameters()]
    boundaries, lrs = [], []
    for tokens, targets in loader:
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        lrs.append(engine.get_lr()[0])
    out["loader_batches"] = len(loader)
    out["boundaries"] = boundaries
    out["lrs"] = lrs
    out["steps"] = (engine.global_steps, engine.micro_steps, engine.global_samples)
    out["grad_norm"] = engine.get_global_grad_norm()
    out["passthrough"] = engine.block1 is model.block1  # attribute pass-through to the module
    # A torch LR scheduler accepts the returned optimizer.
    before = optimizer.param_groups[0]["lr"]
    sched2 = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    out["lambda_lr"] = (before, optimizer.param_groups[0]["lr"])
    del sched2
    engine.destroy()

    # Bad input names the problem.
    m = make_model()
    out["no_optimizer"] = _expect_error(lambda: zeroshard.prepare(m, None, config={}))

    class Lamb(torch.optim.SGD):
        pass

    m = make_model()
    out["lamb"] = _expect_error(lambda: zeroshard.initialize(
        model=m, optimizer=Lamb(m.parameters(), lr=0.1), config={}))
    m, other = make_model(), make_model()
    out["foreign"] = _expect_error(lambda: zeroshard.initialize(
        model=m, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), config={}))
    m = make_model()
    out["unit_class"] = _expect_error(lambda: zeroshard.initialize(
        model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        config={"zero_optimization": {"stage": 3, "zeroshard_unit_classes": ["GPT2Block"]}}))
    m = make_model()
    out["prepare_fp16"] = _expect_error(lambda: zeroshard.prepare(
        m, torch.optim.SGD(m.parameters(), lr=0.1), {"fp16": {"enabled": True}}))
    m = make_model()
    out["optimizer_lamb_config"] = _expect_error(lambda: zeroshard.initialize(
        model=m, config={"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}}))
    m = make_model()
    e, _, _, _ = zeroshard.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                      config={})
    out["backward_non_scalar"] = _expect_error(lambda: e.backward(torch.ones(3, requires_grad=True)))
    e.destroy()
    return out


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """Results of the API walk-through on 2 ranks."""
    path = tmp_path_factory.mktemp("cfg") / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": 8, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 2,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2}}))
    return run_world(2, _api, str(path))


def test_initialize_returns_engine_optimizer_loader_scheduler(api):
    for r in api:
        assert r["types"] == ("Engine", "ZeroOptimizer", "DataLoader", "WarmupLR")
        assert r["batch"] == (8, 2, 2)  # 8 = 2 micro x 2 accumulation x 2 ranks
        assert r["stage"] == 2
        assert r["module_is_model"] and r["names_unchanged"] and r["passthrough"]


def test_dataloader_shards_dataset_at_micro_batch(api):
    for r in api:
        # 16 samples, 2 ranks, micro batch 2 -> 4 batches per rank
        assert r["loader_batches"] == 4


def test_accumulation_boundary_and_counters(api):
    for r in api:
        assert r["boundaries"] == [False, True, False, True]
        assert r["steps"] == (2, 4, 16)
        # WarmupLR (linear, 2 warm-up steps) steps only at boundaries; its k-th step() sets
        # lr = 0.01 * (k-1)/2, DeepSpeed's convention.
        assert r["lrs"] == pytest.approx([0.0, 0.0, 0.0, 0.005])
        assert r["grad_norm"] is not None and r["grad_norm"] > 0


def test_torch_lr_scheduler_accepts_zero_optimizer(api):
    for r in api:
        before, after = r["lambda_lr"]
        assert after == pytest.approx(before * 0.5)


@pytest.mark.parametrize("key,needle", [
    ("no_optimizer", "prepare() needs an optimizer"),
    ("lamb", "Lamb needs whole parameter tensors"),
    ("foreign", "not a parameter of the model"),
    ("unit_class", "zeroshard_unit_classes: no module of class ['GPT2Block'] in TinyLM"),
    ("prepare_fp16", "fp16"),
    ("optimizer_lamb_config", "Lamb"),
    ("backward_non_scalar", "scalar loss"),
])
def test_bad_input_is_named(api, key, needle):
    assert needle in api[0][key], api[0][key]


def test_slurm_environment_starts_a_world(tmp_path):
    script = tmp_path / "slurm.py"
    script.write_text("import zeroshard, torch.distributed as d\n"
                      "zeroshard.init_distributed()\n"
                      "print(d.get_rank(), d.get_world_size(), d.get_backend())\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0",
               SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(_port()))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "gloo"]


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
