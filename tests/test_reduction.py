"""Gradient reduction precision (core/reduction.py): bf16 gradients summed in fp32 by default and
accumulated in fp32 shards, `communication_data_type`, `prescale_gradients` and
`gradient_predivide_factor` with DeepSpeed's meaning, and the comm ledger counting the bytes sent.

Each case compares this rank's averaged gradient shard with a single-process reference that
computes every rank's local gradient itself and averages them in fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

MICRO = 2
STAGES = (0, 1, 2, 3)


def _config(stage, gas=1, **extra):
    stage3 = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **stage3}, **extra}


def _local_grads(batch, rank, world, gas, dtype):
    """Rank `rank`'s gradient of each micro-step, computed here, in `dtype` (as the engine does)."""
    out = []
    for micro in range(gas):
        model = make_model().to(dtype)
        tokens, targets = micro_slice(batch, micro, rank, world, MICRO)
        loss = lm_loss(model(tokens), targets)
        (loss * (1.0 / gas) if gas > 1 else loss).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                    if p.grad is not None})
    return out


def _reference(unit, grads_by_rank, world, micro, sum_dtype, combine):
    """The unit's averaged flat gradient of micro-step `micro`, summed over ranks in `sum_dtype`."""
    flat = torch.zeros(unit.padded_numel, dtype=sum_dtype)
    per_rank = []
    for grads in grads_by_rank:
        local = torch.zeros(unit.padded_numel, dtype=sum_dtype)
        for slot in unit.slots:
            grad = grads[micro].get(slot.name)
            if grad is not None:
                local[slot.offset:slot.offset + slot.numel] = grad.reshape(-1).to(sum_dtype)
        per_rank.append(local)
    return combine(per_rank, world, flat)


def _plain(per_rank, world, flat):
    for local in per_rank:
        flat += local
    return flat.float() / world


def _shards(engine):
    policy = engine.optimizer.policy
    policy.reduce_gradients()
    out = {}
    for unit in engine.optimizer.units:
        out[unit.index] = (unit, policy.owned_bounds(unit), policy.grad_shard(unit).detach().clone())
    engine.optimizer.zero_grad()
    return out


def _run(rank, world, stage, precision, gas, extra, combine, sum_dtype):
    """Engine shards after one accumulation window vs the single-process reference."""
    batch = make_batches(1, MICRO * world * gas)[0]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=_config(stage, gas, bf16={"enabled": precision == "bf16"}, **extra))
    before = engine.comm_report()
    for micro in range(gas):
        tokens, targets = micro_slice(batch, micro, rank, world, MICRO)
        engine.backward(lm_loss(engine(tokens), targets))
        if micro < gas - 1:
            engine.step()
    shards = _shards(engine)
    comm = {k: engine.comm_report()[k] - before[k] for k in ("reduce_scatter", "all_reduce")}
    psi_padded = sum(u.padded_numel for u in engine.optimizer.units)
    engine.destroy()
    grads_by_rank = [_local_grads(batch, r, world, gas, dtype) for r in range(world)]
    equal, close, near, dtypes = True, True, True, set()
    for unit, (lo, hi), got in shards.values():
        expected = torch.zeros(unit.padded_numel)
        for micro in range(gas):  # micro-steps accumulate in the shard, in fp32
            expected += _reference(unit, grads_by_rank, world, micro, sum_dtype, combine)
        equal &= torch.equal(got.float(), expected[lo:hi])
        close &= torch.allclose(got.float(), expected[lo:hi], rtol=1e-6, atol=0)
        near &= torch.allclose(got.float(), expected[lo:hi], rtol=1e-5, atol=1e-7)
        dtypes.add(got.dtype)
    return {"equal": equal, "close": close, "near": near, "dtypes": dtypes, "comm": comm,
            "psi_padded": psi_padded}


def _prescaled(per_rank, world, flat):
    for local in per_rank:
        flat += local * (1.0 / world)
    return flat.float()


def _predivided(factor):
    def combine(per_rank, world, flat):
        for local in per_rank:
            flat += local * (1.0 / factor)
        return flat.float() / (world / factor)
    return combine


def _fp16_sum(rank, world, extra):
    """Gradients of 40000 per rank summed in fp16: 80000 overflows unless pre-divided."""
    layer = nn.Linear(4, 4)
    engine, _, _, _ = zeroshard.initialize(
        model=layer, optimizer=torch.optim.SGD(layer.parameters(), lr=0.1),
        config={"train_micro_batch_size_per_gpu": 1, "communication_data_type": "fp16",
                "zero_optimization": {"stage": 2}, **extra})
    engine.backward((engine(torch.zeros(1, 4)) * 40000.0).sum())  # bias gradient: 40000 each
    shards = _shards(engine)
    engine.destroy()
    values = torch.cat([g for _, _, g in shards.values()])
    return {"finite": bool(torch.isfinite(values).all()), "max": values.abs().max().item(),
            "dtypes": {g.dtype for _, _, g in shards.values()}}


def _all(rank, world):
    out = {}
    fp32_sum = torch.float32
    for stage in STAGES:
        out[("bf16", stage)] = _run(rank, world, stage, "bf16", 1, {}, _plain, fp32_sum)
        out[("bf16-comm-bf16", stage)] = _run(rank, world, stage, "bf16", 1,
                                              {"communication_data_type": "bf16"},
                                              _plain, torch.bfloat16)
        out[("prescale", stage)] = _run(rank, world, stage, "fp32", 1,
                                        {"prescale_gradients": True}, _prescaled, fp32_sum)
        out[("predivide", stage)] = _run(rank, world, stage, "fp32", 1,
                                         {"gradient_predivide_factor": 3.0}, _predivided(3.0),
                                         fp32_sum)
    for stage in (2, 3):  # shards accumulate micro-steps in fp32
        out[("bf16-gas2", stage)] = _run(rank, world, stage, "bf16", 2, {}, _plain, fp32_sum)
    for stage in (0, 1):  # micro-steps before the boundary communicate nothing
        out[("fp32-gas2", stage)] = _run(rank, world, stage, "fp32", 2, {}, _plain, fp32_sum)
    out["fp16-plain"] = _fp16_sum(rank, world, {})
    out["fp16-predivide"] = _fp16_sum(rank, world, {"gradient_predivide_factor": 2.0})
    out["fp16-prescale"] = _fp16_sum(rank, world, {"prescale_gradients": True})
    return out


@pytest.fixture(scope="module")
def results():
    """Every case at world size 2 (rank 0's and rank 1's results)."""
    return run_world(2, _all)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_gradients_are_summed_and_kept_in_fp32(results, stage):
    for got in results:
        case = got[("bf16", stage)]
        assert case["equal"]
        assert case["dtypes"] == {torch.float32}


@pytest.mark.parametrize("stage", (2, 3))
def test_bf16_shards_accumulate_micro_steps_in_fp32(results, stage):
    for got in results:
        case = got[("bf16-gas2", stage)]
        assert case["equal"] and case["dtypes"] == {torch.float32}


@pytest.mark.parametrize("stage", STAGES)
def test_communication_data_type_bf16_sums_in_bf16(results, stage):
    for got in results:
        assert got[("bf16-comm-bf16", stage)]["equal"]


@pytest.mark.parametrize("stage", STAGES)
def test_ledger_counts_the_bytes_sent(results, stage):
    """fp32 reduction of bf16 gradients sends 4 bytes per element, bf16 reduction 2."""
    n = 2
    for got in results:
        for key, elem in ((("bf16", stage), 4), (("bf16-comm-bf16", stage), 2)):
            case = got[key]
            kind = "all_reduce" if stage == 0 else "reduce_scatter"
            ring = 2.0 if stage == 0 else 1.0  # an all-reduce moves twice a reduce-scatter
            assert case["comm"][kind] == ring * case["psi_padded"] * elem * (n - 1) / n, \
                (key, case["comm"])


@pytest.mark.parametrize("stage", STAGES)
def test_prescale_and_predivide_have_deepspeeds_meaning(results, stage):
    for got in results:
        assert got[("prescale", stage)]["equal"]
        # 1/3 before the sum, x 3/2 after it (stages 2-3 multiply where the reference divides)
        assert got[("predivide", stage)]["close"]


def test_fp16_sums_overflow_unless_predivided(results):
    # The bias (gradient 40000 on each rank) lies in one rank's shard.
    assert not all(got["fp16-plain"]["finite"] for got in results)  # 40000 + 40000 > 65504
    for case in ("fp16-predivide", "fp16-prescale"):
        assert all(got[case]["finite"] for got in results)
        assert max(got[case]["max"] for got in results) == 40000.0
    assert all(got["fp16-plain"]["dtypes"] == {torch.float32} for got in results)  # fp32 shards


@pytest.mark.parametrize("stage", (0, 1))
def test_only_the_boundary_backward_communicates(results, stage):
    """Stage 0 all-reduces during backward, but only in the accumulation window's last one."""
    n = 2
    for got in results:
        case = got[("fp32-gas2", stage)]
        kind = "all_reduce" if stage == 0 else "reduce_scatter"
        ring = 2.0 if stage == 0 else 1.0
        assert case["comm"][kind] == ring * case["psi_padded"] * 4 * (n - 1) / n, case["comm"]
        # the sum of two micro-steps, rounded in another order than the reference's
        assert case["near"]
