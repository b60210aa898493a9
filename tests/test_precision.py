"""bf16 tracks the fp32 reference; fp16 overflow skips the step untouched; inf/nan is never applied."""

from __future__ import annotations

import warnings

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice, reference_run

STEPS = 5
MICRO = 2
STAGES = (0, 1, 2, 3)


def _config(stage, **extra):
    # At stage 3 every parameter is sharded (none small enough to stay whole).
    stage3 = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, **stage3}, **extra}


def _snapshot(engine):
    with zeroshard.GatheredParameters(list(engine.module.parameters())):  # whole at stage 3
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = [t.clone() for s in engine.optimizer.state.values() for t in s.values()
             if torch.is_tensor(t)]
    masters = [m.detach().clone() for m in engine.optimizer.masters]
    return params, state, masters


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values())) and \
        all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and \
        all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def _bf16(rank, world, stage):
    batches = make_batches(STEPS, MICRO * world)
    # SGD: errors in the bf16 gradients show up in proportion (Adam would amplify tiny ones).
    ref = reference_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), batches)
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        config=_config(stage, bf16={"enabled": True}))
    # fp32 masters hold the full-precision initial weights, not their bf16 rounding.
    init = dict(make_model().named_parameters())
    masters_exact = True
    for unit, master in zip(engine.optimizer.units, engine.optimizer.masters):
        expected = torch.zeros(unit.padded_numel)
        for slot in unit.slots:
            expected[slot.offset:slot.offset + slot.numel] = init[slot.name].detach().reshape(-1)
        lo, hi = engine.optimizer.policy.owned_bounds(unit)
        masters_exact &= torch.equal(master.detach(), expected[lo:hi])
    for batch in batches:
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
    dtypes = {p.dtype for p in model.parameters()}
    master_dtypes = {m.dtype for m in engine.optimizer.masters}
    engine.destroy()  # leaves a stage-3 model whole
    worst = max(((p.detach().float() - ref[n]).abs().max() / ref[n].abs().max()).item()
                for n, p in model.named_parameters())
    moved = max(((init[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
    return {"worst": worst, "moved": moved, "dtypes": dtypes, "master_dtypes": master_dtypes,
            "masters_exact": masters_exact}


def _fp16_overflow(rank, world, stage):
    """Step 0 clean, step 1 has an inf loss on rank 0 only, step 2 clean again."""
    batches = make_batches(3, MICRO * world)
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        config=_config(stage, fp16={"enabled": True, "hysteresis": 1, "initial_scale_power": 8}))
    log = {"scale0": engine.get_loss_scale()}
    for step, batch in enumerate(batches):
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        loss = lm_loss(engine(tokens), targets)
        if step == 1 and rank == 0:
            loss = loss * float("inf")
        before = _snapshot(engine)
        engine.backward(loss)
        engine.step()
        after = _snapshot(engine)
        log[f"applied{step}"] = engine.was_step_applied()
        log[f"unchanged{step}"] = _same(before, after)
        log[f"scale{step + 1}"] = engine.get_loss_scale()
    log["skipped"] = engine.skipped_steps
    log["global_steps"] = engine.global_steps
    engine.destroy()
    return log


def _nonfinite_error(rank, world, stage):
    """fp32: a nan loss on one rank raises on every rank and leaves parameters untouched."""
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_config(stage))
    tokens, targets = micro_slice(make_batches(1, MICRO * world)[0], 0, rank, world, MICRO)
    loss = lm_loss(engine(tokens), targets)
    if rank == world - 1:
        loss = loss * float("nan")
    before = _snapshot(engine)
    engine.backward(loss)
    try:
        engine.step()
        message = None
    except zeroshard.NonFiniteGradientError as err:
        message = str(err)
    unchanged = _same(before, _snapshot(engine))
    counters = (engine.global_steps, engine.micro_steps, engine.skipped_steps)
    engine.destroy()
    return {"message": message, "unchanged": unchanged, "counters": counters}


def _bf16_nonfinite(rank, world, stage, check):
    """bf16: a nan loss on one rank; DeepSpeed's check_grad_overflow skips the step on every rank
    (the scheduler does not move), without it the step is refused as at fp32."""
    model = make_model()
    engine, _, _, sched = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
        config=_config(stage, bf16={"enabled": True, "check_grad_overflow": check}))
    batch = make_batches(1, MICRO * world)[0]
    tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
    loss = lm_loss(engine(tokens), targets)
    if rank == world - 1:
        loss = loss * float("nan")
    before = _snapshot(engine)
    engine.backward(loss)
    message = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            engine.step()
        except zeroshard.NonFiniteGradientError as err:
            message = str(err)
    out = {"message": message, "unchanged": _same(before, _snapshot(engine)),
           "applied": engine.was_step_applied(), "lr": engine.get_lr()[0],
           "warned": [str(w.message) for w in seen if "check_grad_overflow" in str(w.message)],
           "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps)}
    engine.backward(lm_loss(engine(tokens), targets))  # the next finite step is applied
    engine.step()
    out["next"] = (engine.was_step_applied(), engine.get_lr()[0], engine.skipped_steps)
    engine.destroy()
    return out


def _min_scale_error(rank, world, stage):
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=_config(stage, fp16={"enabled": True, "hysteresis": 1, "initial_scale_power": 1,
                                    "min_loss_scale": 1}))
    tokens, targets = micro_slice(make_batches(1, MICRO * world)[0], 0, rank, world, MICRO)
    try:
        for _ in range(3):
            engine.backward(lm_loss(engine(tokens), targets) * float("inf"))
            engine.step()
        message = None
    except zeroshard.LossScaleError as err:
        message = str(err)
    engine.destroy()
    return message


def _stage0_without_norm(rank, world):
    """Stage 0 without clipping or loss scaling: no gradient norm before the step (DDP forms
    none); the norm is formed when asked for, and the inf/nan check is the losses'."""
    batches = make_batches(3, MICRO * world)

    def engine_with(clip):
        model = make_model()
        engine, _, _, _ = zeroshard.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            config=_config(0, gradient_clipping=clip))
        return engine

    def loss_of(engine, batch):
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        return lm_loss(engine(tokens), targets)

    # A clip that never bites forms the norm before every step: the reference.
    lazy, eager, stale = engine_with(0.0), engine_with(1e9), engine_with(0.0)
    out = {"norms": [], "formed_before_asked": []}
    for i, batch in enumerate(batches):
        for engine in (lazy, eager, stale):
            engine.backward(loss_of(engine, batch))
            if engine is stale and i == 1:  # asked only after the next backward wrote
                out["stale_answer"] = stale.get_global_grad_norm()
            engine.step()
        out["formed_before_asked"].append(lazy.optimizer.norm.value is not None)
        out["norms"].append((lazy.get_global_grad_norm(), eager.get_global_grad_norm(),
                             stale.get_global_grad_norm() if i else None))
    out["same_params"] = all(torch.equal(a, b) for a, b in zip(lazy.module.parameters(),
                                                               eager.module.parameters()))
    for engine in (lazy, eager, stale):
        engine.destroy()
    # The script's own loss.backward(): its loss is not seen, so the gradients are checked.
    engine = engine_with(0.0)
    loss = loss_of(engine, batches[0])
    loss.backward()
    engine.step()
    out["direct_formed"] = engine.optimizer.norm.value is not None
    loss = loss_of(engine, batches[1])
    if rank == world - 1:
        loss = loss * float("nan")
    before = _snapshot(engine)
    loss.backward()
    try:
        engine.step()
        out["direct_nan"] = None
    except zeroshard.NonFiniteGradientError as err:
        out["direct_nan"] = str(err)
    out["direct_unchanged"] = _same(before, _snapshot(engine))
    engine.destroy()
    # Accumulation: an inf loss in the first micro-step (which does not communicate) of one rank
    # still refuses the step the window ends with, on every rank.
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=_config(0, gradient_clipping=0.0, gradient_accumulation_steps=2))
    before = _snapshot(engine)
    window = make_batches(1, MICRO * world * 2)[0]
    for micro in range(2):
        tokens, targets = micro_slice(window, micro, rank, world, MICRO)
        loss = lm_loss(engine(tokens), targets)
        engine.backward(loss * float("inf") if micro == 0 and rank == 0 else loss)
        try:
            engine.step()
            out.setdefault("accumulated", None)
        except zeroshard.NonFiniteGradientError as err:
            out["accumulated"] = (micro, "inf/nan" in str(err))
    out["accumulated_unchanged"] = _same(before, _snapshot(engine))
    engine.destroy()
    return out


def _all(rank, world):
    return {stage: {"bf16": _bf16(rank, world, stage), "fp16": _fp16_overflow(rank, world, stage),
                    "nonfinite": _nonfinite_error(rank, world, stage),
                    "bf16_skip": _bf16_nonfinite(rank, world, stage, True),
                    "bf16_raise": _bf16_nonfinite(rank, world, stage, False),
                    "min_scale": _min_scale_error(rank, world, stage),
                    **({"no_norm": _stage0_without_norm(rank, world)} if stage == 0 else {})}
            for stage in STAGES}


@pytest.fixture(scope="module")
def results():
    """Per-rank results of every precision case at world size 2."""
    return run_world(2, _all)


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_tracks_fp32_reference(results, stage):
    for rank_result in results:
        got = rank_result[stage]["bf16"]
        assert got["dtypes"] == {torch.bfloat16}
        assert got["master_dtypes"] == {torch.float32}
        assert got["masters_exact"]
        # bf16 keeps 8 mantissa bits: forward/backward in bf16 perturbs gradients by ~1%, so
        # after five steps parameters stay within a few percent, far less than training moved them.
        assert got["worst"] < 3e-2, got["worst"]
        assert got["worst"] < got["moved"] / 5, (got["worst"], got["moved"])


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_overflow_skips_step_and_halves_scale(results, stage):
    for rank_result in results:
        got = rank_result[stage]["fp16"]
        assert got["scale0"] == 2.0 ** 8
        assert got["applied0"] and not got["unchanged0"]
        # The inf on rank 0 reaches every rank through the global norm: all skip together.
        assert not got["applied1"] and got["unchanged1"]
        assert got["scale2"] == got["scale1"] / 2
        assert got["applied2"] and not got["unchanged2"]
        assert got["skipped"] == 1 and got["global_steps"] == 3


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_check_grad_overflow_skips_the_step_on_every_rank(results, stage):
    """DeepSpeed 0.19.3+'s default: a bf16 step with an inf/nan gradient is skipped, counted in
    skipped_steps, the LR schedule waits; the next finite step is applied."""
    for rank, rank_result in enumerate(results):
        got = rank_result[stage]["bf16_skip"]
        assert got["message"] is None, f"rank {rank}: {got['message']}"
        assert got["unchanged"] and not got["applied"]
        assert got["counters"] == (1, 1, 1) and got["lr"] == 0.1
        assert bool(got["warned"]) == (rank == 0), got["warned"]  # one line, from rank 0
        assert got["next"] == (True, 0.05, 1)
        off = rank_result[stage]["bf16_raise"]
        assert off["message"] is not None and "not applied" in off["message"]
        assert off["unchanged"] and off["counters"] == (1, 1, 1)


@pytest.mark.parametrize("stage", STAGES)
def test_nonfinite_gradient_raises_and_changes_nothing(results, stage):
    for rank, rank_result in enumerate(results):
        got = rank_result[stage]["nonfinite"]
        assert got["message"] is not None, f"rank {rank} did not raise"
        assert "inf/nan" in got["message"] and "not applied" in got["message"]
        assert got["unchanged"]
        # counted as a skipped step, so a caller that catches the error stays on schedule
        assert got["counters"] == (1, 1, 1)


def test_stage0_without_clipping_forms_the_norm_only_when_asked(results):
    for rank_result in results:
        got = rank_result[0]["no_norm"]
        # Not formed before the first ask; from then on every step forms it.
        assert got["formed_before_asked"] == [False, True, True]
        for lazy, eager, _ in got["norms"]:
            assert lazy == pytest.approx(eager, rel=1e-6) and eager > 0
        # Asked first once the next backward had written over the gradients: no norm rather
        # than a wrong one; the step after that forms it.
        assert got["stale_answer"] is None
        for _, eager, stale in got["norms"][1:]:
            assert stale == pytest.approx(eager, rel=1e-6)
        assert got["same_params"]  # the two paths apply the same update


def test_stage0_checks_the_gradients_when_it_does_not_see_the_loss(results):
    for rank, rank_result in enumerate(results):
        got = rank_result[0]["no_norm"]
        assert got["direct_formed"]
        assert got["direct_nan"] is not None and "inf/nan" in got["direct_nan"], rank
        assert got["direct_unchanged"]
        assert got["accumulated"] == (1, True), rank  # raised at the boundary, micro-step 1
        assert got["accumulated_unchanged"]


def test_loss_check_verdict():
    from zeroshard.core.step_check import LossCheck

    alone = LossCheck(1)
    assert alone.verdict() is None  # no backward noted: the gradients are checked
    alone.note(torch.tensor(1.5))
    assert alone.verdict().item() == 0.0
    alone.note(torch.tensor(float("inf")))
    alone.note(torch.tensor(2.0))
    assert alone.verdict().item() == 1.0  # any loss of the window
    alone.note(None)
    assert alone.verdict() is None  # one backward's loss unseen
    alone.zero_grad()
    alone.note(torch.tensor(float("nan")))
    assert alone.verdict().item() == 1.0
    carried = LossCheck(2)
    carried.note(torch.tensor(1.0))
    assert carried.verdict() is None  # not exchanged yet
    slot = torch.zeros(1)
    carried.write(slot)
    carried.note(torch.tensor(1.0))  # a backward after the flags were sent
    carried.land(slot + 1.0)  # another rank's inf/nan
    assert carried.verdict() is None
    carried.write(slot)
    carried.land(slot + 1.0)
    assert carried.verdict().item() == 1.0


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_error_at_min_loss_scale(results, stage):
    for rank_result in results:
        message = rank_result[stage]["min_scale"]
        assert message is not None and "minimum" in message
