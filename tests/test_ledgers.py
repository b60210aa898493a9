"""Memory and comm ledgers reproduce the ZeRO ratios, derived here from the parameter count.

Expected bytes come from Psi (the model's parameter count) and the paper's formulas; the only
allowance is padding (one unit, so at most N x 16 elements per buffer) and a few scalars.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_world

WORLDS = (2, 4)
PAD = 16  # elements of alignment per shard: the padding allowance per rank per unit
# Stage 3 with every parameter sharded and nothing prefetched or kept: the paper's 3 x Psi.
LEAN = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0}
# Prefetch and reuse as much as the live bound (one Linear(256, 256) unit) allows.
BOUNDED = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 10**9,
           "stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 256 * 257}
REUSE = {"stage3_param_persistence_threshold": 0}  # DeepSpeed's default prefetch/reuse/live


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _measure(rank, world):
    out = {}
    runs = [(p, s, LEAN if s == 3 else {}) for p in ("fp32", "bf16") for s in (0, 1, 2, 3)]
    runs += [("fp32", "3-bounded", BOUNDED), ("fp32", "3-reuse", REUSE)]
    for precision, stage, stage3 in runs:
        model = _model()
        psi = sum(p.numel() for p in model.parameters())
        config = {"train_micro_batch_size_per_gpu": 4,
                  "zero_optimization": {"stage": int(str(stage)[0]),
                                        "reduce_bucket_size": 10**9, **stage3},
                  "bf16": {"enabled": precision == "bf16"}}
        engine, _, _, _ = zeroshard.initialize(
            model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
            config=config)
        x = torch.randn(4, 64)
        for step in range(3):
            before = engine.comm_report()
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
            after = engine.comm_report()
            # The ranks' step counts ride along in one all-reduce per step (core/step_check.py):
            # counted apart as "step_check", they are not gradient or parameter bytes.
            check = after["step_check"] - before["step_check"]
            comm = after["total"] - before["total"] - check
        report = engine.memory_report()
        policy = engine.optimizer.policy
        out[(precision, stage)] = {
            "psi": psi, "comm": comm, "check": check, "units": len(engine.optimizer.units),
            "peak_live": policy.params.peak_live_numel if str(stage).startswith("3") else None,
            "largest": max(u.padded_numel for u in engine.optimizer.units),
            **{kind: sum(report[kind].values()) for kind in ("params", "grads", "optimizer")}}
        engine.destroy()
    out["hosts"] = _measure_host_split(world)
    return out


def _measure_host_split(world):
    """One stage-3 step's comm report with the world laid out as hosts of P ranks (P dividing N),
    the layout torchrun's LOCAL_WORLD_SIZE describes."""
    out = {}
    for per_host in [p for p in (1, 2, world) if world % p == 0]:
        os.environ["LOCAL_WORLD_SIZE"] = str(per_host)
        try:
            model = _model()
            engine, _, _, _ = zeroshard.initialize(
                model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                config={"train_micro_batch_size_per_gpu": 4,
                        "zero_optimization": {"stage": 3, **LEAN}})
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
        engine.backward(engine(torch.randn(4, 64)).pow(2).mean())
        engine.step()
        out[per_host] = engine.comm_report()
        engine.destroy()
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"world{n}")
def ledgers(request):
    """Rank 0's ledgers after three steps, for every precision and stage, at one world size."""
    return request.param, run_world(request.param, _measure)[0]


def _close(measured: int, expected: float, slack_bytes: float) -> bool:
    return expected - 1 <= measured <= expected + slack_bytes


@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_zero_formulas(ledgers, precision, elem, stage):
    n, result = ledgers
    got = result[(precision, stage)]
    psi = got["psi"]
    pad = n * PAD * got["units"]  # each unit pads by fewer than N*16 elements
    # Parameters (between steps): whole at stages 0-2, 1/N at stage 3, in the compute dtype.
    param_share = psi / n if stage == 3 else psi
    assert _close(got["params"], elem * param_share, elem * pad)
    # Gradients: whole (stages 0-1) in the compute dtype, or 1/N (stages 2-3) in fp32: the
    # shards accumulate micro-steps in the masters' dtype (core/reduction.py).
    grad_share = psi / n if stage >= 2 else psi
    grad_elem = 4 if stage >= 2 else elem
    assert _close(got["grads"], grad_elem * grad_share, grad_elem * pad)
    # Optimizer: Adam m and v in fp32 (8 bytes), plus an fp32 master copy in mixed precision
    # (the paper's K = 12); whole at stage 0, 1/N from stage 1.
    k = 8 if precision == "fp32" else 12
    opt_share = psi if stage == 0 else psi / n
    assert _close(got["optimizer"], k * opt_share, k * pad + 64), (got["optimizer"], k * opt_share)


@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_per_step_is_two_or_three_psi(ledgers, precision, elem, stage):
    n, result = ledgers
    got = result[(precision, stage)]
    collectives = 3 if stage == 3 else 2  # stage 3 gathers in forward and again in backward
    # Gradients are summed in fp32 (4 bytes, also for bf16: core/reduction.py); parameters are
    # gathered in the compute dtype. Stage 0's all-reduce counts as two of them.
    gathers = collectives - 2 if stage == 0 else collectives - 1
    per_elem = gathers * elem + (collectives - gathers) * 4
    expected = got["psi"] * per_elem * (n - 1) / n
    # Allowance: padding of each unit, and the scalar norm all-reduce (8 bytes, ring x2).
    slack = n * PAD * got["units"] * per_elem + 2 * 8
    assert expected - 1 <= got["comm"] <= expected + slack, (got["comm"], expected)
    # The step counts: two elements per rank in one all-reduce a step, in the gradients'
    # communication dtype (fp32) at stage 0, in the norm's float64 above; at stage 0 one more
    # element after them, the losses' inf/nan flag (step_check.LossCheck).
    check_elem = 4 if stage == 0 else 8
    carried = 2 * n + (1 if stage == 0 else 0)
    assert got["check"] == round(2 * carried * check_elem * (n - 1) / n), got["check"]


def test_stage3_live_parameters_stay_within_the_bound(ledgers):
    """Prefetch and reuse never take gathered elements past max_live + the unit being used."""
    n, result = ledgers
    got = result[("fp32", "3-bounded")]
    bound = BOUNDED["stage3_max_live_parameters"]
    assert got["peak_live"] <= bound + got["largest"], (got["peak_live"], bound)
    assert got["params"] == result[("fp32", 3)]["params"]  # freed again between steps


def test_stage3_reuse_saves_backward_gathers(ledgers):
    """With DeepSpeed's default reuse distance the backward re-gathers nothing this small model
    needs again at once: between 2 and 3 x Psi."""
    n, result = ledgers
    got = result[("fp32", "3-reuse")]
    psi_bytes = got["psi"] * 4 * (n - 1) / n
    assert 2 * psi_bytes - 1 <= got["comm"] < 3 * psi_bytes, (got["comm"], psi_bytes)


def test_stage_ratios(ledgers):
    n, result = ledgers
    s0, s1, s2 = (result[("fp32", s)] for s in (0, 1, 2))
    assert s1["optimizer"] == pytest.approx(s0["optimizer"] / n, rel=0.01)
    assert s2["grads"] == pytest.approx(s0["grads"] / n, rel=0.01)
    assert s0["params"] == s1["params"] == s2["params"]


def test_comm_splits_into_intra_and_inter_host(ledgers):
    """Hosts of P ranks in rank order: 1/P of every rank's bytes cross hosts when there are
    several hosts (comm.py's ring model: H of the N hops), none on one host, all at P = 1."""
    n, result = ledgers
    for per_host, report in result["hosts"].items():
        kinds = sum(report[k] for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                        "step_check"))
        assert report["intra_host"] + report["inter_host"] == report["total"] == kinds > 0
        share = 0.0 if per_host == n else 1 / per_host
        # Rounding: at most half a byte per collective; a step has fewer than 100 here.
        assert abs(report["inter_host"] - share * report["total"]) <= 50, (per_host, report)
