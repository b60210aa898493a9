"""Checkpoints saved by an earlier zeroshard still load: the fixtures in `tests/fixtures/ckpt_v1/`
(format 1, 2 ranks, stages 1-3 and bf16, AdamW after 2 steps; see `make_ckpt_v1.py`) load at 2
ranks into a fresh engine with every parameter, optimizer state tensor and counter bitwise as the
saving engine held them, and the next step matches plain torch continuing from those values."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.fixtures.make_ckpt_v1 import (BETAS, CASES, EPS, LR, ROOT, WD, full_state, make_engine,
                                         make_net, train_step)
from tests.harness import run_world


def _load_all(rank, world):
    """Per case: what the loaded engine holds, and its masters after one more step."""
    out = {}
    for case, (stage, bf16) in CASES.items():
        root = os.path.join(ROOT, case)
        expected = torch.load(os.path.join(root, "expected.pt"), weights_only=True)
        torch.manual_seed(99 + rank)  # the checkpoint's values must win over fresh ones
        engine = make_engine(stage, bf16)
        path, client = engine.load_checkpoint(root)
        masters, optim = full_state(engine)
        module = engine.consolidated_state_dict(rank0_only=False)
        counters = {k: getattr(engine, k) for k in expected["counters"]}
        hyper = [{k: v for k, v in g.items() if k != "params"}
                 for g in engine.optimizer.param_groups]
        train_step(engine, expected["next_batch"], rank)
        after, _ = full_state(engine)
        engine.destroy()
        out[case] = {"path": path, "client": client, "masters": masters, "optim": optim,
                     "module": module, "counters": counters, "hyper": hyper, "after": after}
    return out


@pytest.fixture(scope="module")
def loaded():
    if not os.path.isdir(ROOT):
        pytest.fail(f"{ROOT} is missing: it is committed with the repository")
    return run_world(2, _load_all)


def _expected(case):
    return torch.load(os.path.join(ROOT, case, "expected.pt"), weights_only=True)


def _plain_continuation(expected) -> dict[str, torch.Tensor]:
    """One AdamW step of plain torch from the saved masters and optimizer state."""
    model = make_net()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected["master"][name])
        model.scale.copy_(expected["module"]["scale"].float())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for name, p in model.named_parameters():
        saved = expected["optim"][name]
        opt.state[p] = {"step": saved["step"].clone(), "exp_avg": saved["exp_avg"].clone(),
                        "exp_avg_sq": saved["exp_avg_sq"].clone()}
    x, y = expected["next_batch"]
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_loads_bitwise(loaded, case):
    expected = _expected(case)
    for rank, result in enumerate(loaded):
        got = result[case]
        assert got["path"] == os.path.join(ROOT, case, "global_step2")
        assert got["client"]["case"] == case and torch.equal(got["client"]["seen"], torch.arange(3))
        assert got["counters"] == expected["counters"]
        assert got["hyper"][0]["lr"] == LR and tuple(got["hyper"][0]["betas"]) == BETAS
        assert sorted(got["masters"]) == sorted(expected["master"])
        for name, value in expected["master"].items():
            assert torch.equal(got["masters"][name], value), (case, rank, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got["optim"][name][key], expected["optim"][name][key]), \
                    (case, rank, name, key)
            assert float(got["optim"][name]["step"]) == float(expected["optim"][name]["step"]) == 2
        for name, value in expected["module"].items():
            assert got["module"][name].dtype == value.dtype, (case, name)
            assert torch.equal(got["module"][name], value), (case, rank, name)


@pytest.mark.parametrize("case", list(CASES))
def test_next_step_continues(loaded, case):
    expected = _expected(case)
    plain = _plain_continuation(expected)
    for rank, result in enumerate(loaded):
        after = result[case]["after"]
        for name, value in expected["after_step"].items():
            # The step the saving engine took next, with the code that saved.
            torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-7)
            moved = (after[name] - expected["master"][name]).abs().max()
            assert moved > 1e-4, (case, name)  # the step really changed the parameter
            if not expected["bf16"]:
                # Plain torch from the saved values; bf16 computes in another precision.
                torch.testing.assert_close(after[name], plain[name], rtol=1e-5, atol=1e-6)
