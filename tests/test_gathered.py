"""GatheredParameters / Init at stages 0-2: the modifier rank's in-place change reaches every rank
and survives the next optimizer step (fp32 masters refreshed); without it changes stay local.
(Stage 3 is covered in test_stage3.py.)"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

CASES = [(stage, precision) for stage in (0, 1, 2) for precision in ("fp32", "bf16")]


def _case(rank, world, stage, precision):
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": precision == "bf16"},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}
    # lr 0: a step changes nothing, so whatever the step writes back must be the modified value.
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    weight = model.block2[1].weight
    with zeroshard.GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    synced = bool((weight == 0.5).all())
    tokens, targets = micro_slice(make_batches(1, 2 * world)[0], 0, rank, world, 2)
    engine.backward(lm_loss(engine(tokens), targets))
    engine.step()
    kept = bool((weight == 0.5).all())
    # Without modifier_rank a change stays on the rank that made it.
    bias = model.block2[1].bias
    before = bias.detach().clone()
    with zeroshard.zero.GatheredParameters([bias], modifier_rank=None):
        if rank == 0:
            bias.data.add_(1.0)
    local = bool(torch.equal(bias.detach(), before + 1.0)) if rank == 0 else \
        bool(torch.equal(bias.detach(), before))
    with zeroshard.GatheredParameters(p for p in model.block1.parameters()):
        pass  # a generator is accepted
    engine.destroy()
    return {"synced": synced, "kept": kept, "local": local}


def _all(rank, world):
    out = {case: _case(rank, world, *case) for case in CASES}
    with zeroshard.Init(config={"zero_optimization": {"stage": 2}}):
        built = make_model()
    plain = make_model()
    # Below stage 3 Init builds normally: whole parameters, the same values, no stage-3 marks.
    out["init_plain"] = not any(hasattr(p, "ds_numel") for p in built.parameters()) and all(
        torch.equal(a, b) for a, b in zip(built.state_dict().values(), plain.state_dict().values()))
    return out


@pytest.fixture(scope="module")
def results():
    """Per-rank results at world size 2."""
    return run_world(2, _all)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_modifier_rank_change_reaches_all_ranks_and_survives_a_step(results, case):
    for rank, got in enumerate(results):
        assert got[case]["synced"], f"rank {rank} did not receive rank 0's change"
        assert got[case]["kept"], f"rank {rank}: the optimizer step reverted the change"
        assert got[case]["local"], f"rank {rank}: a change without modifier_rank was not local"


def test_init_is_plain_construction_below_stage_3(results):
    assert all(r["init_plain"] for r in results)
