"""Offload without stalls (offload/early.py, offload/param.py): the CPU optimizer step per unit
during the boundary backward, and offloaded parameter shards copied to the device ahead of their
all-gather.

One world of 2 ranks runs every case. The per-unit step is compared bitwise with the same run
stepping after backward (`zeroshard_step_in_backward: false`), at stages 2-3, fp32 and bf16, fused
AdamW and SGD, under an LR schedule that changes every step; it stays off where the global norm is
needed first (clipping, fp16) and for a plain `loss.backward()` loop; an LR changed between
backward and step, a checkpoint saved in between, a NaN loss and a reentrant-checkpointed model
are handled. The read-ahead of CPU parameter shards equals the run without it, holds at most its
bound, and never serves a copy older than a write to the shard.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

WORLD = 2
MICRO = 2
GAS = 2
STEPS = 3


def _config(stage, early=True, precision="fp32", clip=0.0, param=None, **zero):
    zero = {"stage": stage, "reduce_bucket_size": 100,
            "offload_optimizer": {"device": "cpu", "zeroshard_step_in_backward": early}, **zero}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if param:
        zero["offload_param"] = {"device": param, "buffer_count": 3}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            # a step that may be skipped (bf16's check_grad_overflow) is not stepped in backward
            "gradient_clipping": clip, "bf16": {"enabled": precision == "bf16",
                                                "check_grad_overflow": False},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
            "zero_optimization": zero}


def _engine(config, optimizer="adamw", checkpoint=None):
    model = make_model(checkpoint=checkpoint)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # The LR of every step differs from the last one's: a unit stepped with a stale LR shows.
    sched = torch.optim.lr_scheduler.LambdaLR  # built over the engine's optimizer below
    engine, zopt, _, scheduler = zeroshard.initialize(
        model=model, optimizer=opt, config=config,
        lr_scheduler=lambda o: sched(o, lambda step: 1.0 / (1 + step)))
    return engine, model


def _train(engine, rank, steps=STEPS, seed=1, nan_at=None):
    for step, batch in enumerate(make_batches(steps, MICRO * GAS * WORLD, seed=seed)):
        for micro in range(GAS):
            tokens, targets = micro_slice(batch, micro, rank, WORLD, MICRO)
            loss = lm_loss(engine(tokens), targets)
            if step == nan_at:
                loss = loss * math.nan
            engine.backward(loss)
            engine.step()


def _params(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _counts(engine):
    early = engine.optimizer.placement.early
    return None if early is None else dict(early.counts)


def _bitwise(rank):
    out = {}
    for stage, precision, optimizer in ((2, "fp32", "adamw"), (3, "fp32", "adamw"),
                                        (2, "bf16", "sgd"), (3, "bf16", "adamw")):
        runs = {}
        for early in (True, False):
            engine, model = _engine(_config(stage, early, precision), optimizer)
            _train(engine, rank)
            runs[early] = (_params(model), engine.get_global_grad_norm(), _counts(engine),
                           engine.get_lr())
            engine.destroy()
        (on, norm_on, counts, lr_on), (off, norm_off, _, lr_off) = runs[True], runs[False]
        out[f"s{stage}-{precision}-{optimizer}"] = {
            "equal": all(torch.equal(on[k], off[k]) for k in off), "norms": (norm_on, norm_off),
            "counts": counts, "lrs": (lr_on, lr_off)}
    return out


def _fallbacks(rank):
    out = {}
    skippable = _config(2, precision="bf16")
    skippable["bf16"]["check_grad_overflow"] = True
    for name, config in (("clipping", _config(2, clip=1.0)), ("fp16", _config(2, precision="fp16")),
                         ("bf16 check_grad_overflow", skippable),
                         ("default on a CPU device", _config(2, early=None))):
        engine, _ = _engine(config)
        _train(engine, rank, steps=1)
        out[name] = _counts(engine)
        engine.destroy()
    # A plain loop: nobody says which backward ends the window, so nothing steps early.
    model = make_model()
    config = _config(3)
    config["gradient_accumulation_steps"] = 1
    model, opt = zeroshard.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                   config=config)
    for tokens, targets in make_batches(2, MICRO * WORLD):
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        lm_loss(model(tokens[sl]), targets[sl]).backward()
        opt.step()
        opt.zero_grad()
    out["prepare"] = dict(opt.placement.early.counts)
    return out


def _between_backward_and_step(rank, root):
    """An LR changed, or a checkpoint saved, after the boundary backward stepped units."""
    out = {}
    engine, _ = _engine(_config(2))
    _train(engine, rank, steps=1)
    tokens, targets = micro_slice(make_batches(1, MICRO * GAS * WORLD)[0], 0, rank, WORLD, MICRO)
    for micro in range(GAS):
        engine.backward(lm_loss(engine(tokens), targets))
        if micro < GAS - 1:
            engine.step()
    try:
        engine.save_checkpoint(os.path.join(root, "between"), tag="mid-step")
        out["save"] = None
    except RuntimeError as err:
        out["save"] = str(err)
    engine.optimizer.param_groups[0]["lr"] *= 0.5
    try:
        engine.step()
        out["lr"] = None
    except RuntimeError as err:
        out["lr"] = str(err)
    engine.destroy()
    return out


def _checkpoint(rank, root):
    """Saved from a run stepping during backward, loaded into one that does not (and back):
    both continue exactly as the run that was never interrupted."""
    out = {}
    ckpt = os.path.join(root, "ckpt")
    engine, model = _engine(_config(3))
    _train(engine, rank, steps=2)
    engine.save_checkpoint(ckpt, tag="a")
    _train(engine, rank, steps=2, seed=7)
    engine.destroy()
    straight = _params(model)
    for name, early in (("into-after-backward", False), ("into-in-backward", True)):
        engine, model = _engine(_config(3, early))
        engine.load_checkpoint(ckpt, tag="a")
        _train(engine, rank, steps=2, seed=7)
        counts = _counts(engine)
        engine.destroy()
        out[name] = (all(torch.equal(straight[k], v) for k, v in _params(model).items()), counts)
    return out


def _nan_loss(rank):
    """A NaN loss at a boundary: refused as after backward, nothing updated, training goes on
    exactly as the run stepping after backward."""
    out = {}
    for early in (True, False):
        engine, model = _engine(_config(2, early))
        _train(engine, rank, steps=1)
        before = _params(model)
        try:
            _train(engine, rank, steps=1, seed=3, nan_at=0)
            error = None
        except zeroshard.NonFiniteGradientError as err:
            error = str(err)
        unchanged = all(torch.equal(before[k], v) for k, v in _params(model).items())
        _train(engine, rank, steps=1, seed=4)
        out[early] = (error, unchanged, _params(model))
        engine.destroy()
    on, off = out[True], out[False]
    return {"errors": (on[0] is not None, off[0] is not None), "unchanged": (on[1], off[1]),
            "equal": all(torch.equal(on[2][k], off[2][k]) for k in off[2])}


def _reentrant(rank):
    """A reentrantly checkpointed model: stepping during backward or not, the same result."""
    runs = {}
    for early in (True, False):
        engine, model = _engine(_config(2, early), checkpoint="reentrant")
        _train(engine, rank)
        runs[early] = (_params(model), _counts(engine))
        engine.destroy()
    return {"equal": all(torch.equal(runs[True][0][k], v) for k, v in runs[False][0].items()),
            "counts": runs[True][1]}


def _host_syncs(rank):
    """Stepping during backward, a step waits on the host once: for the overflow flag."""
    engine, _ = _engine(_config(3))
    per_step = []
    for seed in range(3):
        engine.optimizer.syncs.reset()
        _train(engine, rank, steps=1, seed=seed)
        per_step.append(dict(engine.optimizer.syncs.counts))
    engine.destroy()
    return per_step


def _prefetch(rank):
    """offload_param cpu: reads ahead equal no read-ahead; bounded; never stale."""
    out = {}
    runs = {}
    # A prefetch bucket of one element: no gather is started early, so every unit's shard
    # reaches the device through the read-ahead (or, without it, just before its gather).
    for name, ahead, budget in (("ahead", 3, None), ("byte-budget", 3, "largest"),
                                ("none", 0, None)):
        engine, model = _engine(_config(3, param="cpu", stage3_prefetch_bucket_size=1))
        store = engine.optimizer.policy.store
        store.ahead = ahead
        if budget:  # room for the largest shard only
            store.ahead_numel = max(u.shard_numel for u in store.units.values())
        _train(engine, rank)
        runs[name] = _params(model)
        out[name] = {"hits": store.hits, "peak": store.peak_prefetched,
                     "peak_numel": store.peak_numel, "budget": store.ahead_numel,
                     "left": len(store.prefetched)}
        engine.destroy()
    out["equal"] = all(torch.equal(runs["ahead"][k], runs["none"][k]) and
                       torch.equal(runs["byte-budget"][k], runs["none"][k]) for k in runs["none"])
    # A copy read ahead, then the shard written (an optimizer step, a commit): the gather's
    # source holds the new values.
    engine, _ = _engine(_config(3, param="cpu"))
    store = engine.optimizer.policy.store
    unit = next(u for u in store.units.values() if not u.is_gathered and u.shard_numel)
    ledger_before = engine.memory_report()["buffers"].get("device", 0)
    store.read_ahead([unit.index])
    read_ahead = unit.index in store.prefetched
    # The ledger counts the device copy under device buffers.
    out["ledger"] = (engine.memory_report()["buffers"].get("device", 0) - ledger_before,
                     unit.shard_numel * unit.shard.element_size())
    new = torch.full_like(unit.shard, 0.25)
    store.write(unit, new)
    source = store.source(unit)
    out["stale"] = {"read_ahead": read_ahead, "fresh": torch.equal(source.cpu(), new.cpu())}
    store.done(unit)
    engine.destroy()
    return out


def _world(rank, world, root):
    torch.manual_seed(0)
    return {"bitwise": _bitwise(rank), "fallbacks": _fallbacks(rank),
            "between": _between_backward_and_step(rank, root),
            "checkpoint": _checkpoint(rank, root),
            "nan": _nan_loss(rank), "reentrant": _reentrant(rank), "syncs": _host_syncs(rank),
            "prefetch": _prefetch(rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(WORLD, _world, str(tmp_path_factory.mktemp("overlap")))


def test_step_in_backward_is_bitwise_equal_to_the_step_after_backward(results):
    for got in results:
        for case, r in got["bitwise"].items():
            assert r["equal"], case
            assert r["norms"][0] == r["norms"][1], case
            assert r["lrs"][0] == r["lrs"][1], case
            # Every step from the first stepped every unit as it landed (the first micro-step's
            # backward shows there are no late gradients).
            assert r["counts"]["in backward"] > 0 and not r["counts"].get("after backward"), case


def test_step_stays_after_backward_where_the_global_norm_comes_first(results):
    for got in results:
        assert got["fallbacks"]["clipping"] is None
        assert got["fallbacks"]["fp16"] is None
        assert got["fallbacks"]["bf16 check_grad_overflow"] is None
        assert got["fallbacks"]["default on a CPU device"] is None
        assert got["fallbacks"]["prepare"].get("in backward", 0) == 0


def test_lr_change_and_save_between_backward_and_step_are_refused(results):
    for got in results:
        assert "engine.step() before saving" in got["between"]["save"]
        assert "param group 0: lr changed" in got["between"]["lr"]


def test_checkpoints_cross_between_both_schedules(results):
    for got in results:
        for name, (equal, _) in got["checkpoint"].items():
            assert equal, name
        assert got["checkpoint"]["into-in-backward"][1]["in backward"] > 0


def test_nan_loss_is_refused_with_nothing_updated(results):
    for got in results:
        assert got["nan"]["errors"] == (True, True)
        assert got["nan"]["unchanged"] == (True, True)
        assert got["nan"]["equal"]


def test_reentrant_checkpointing_gives_the_same_result(results):
    for got in results:
        assert got["reentrant"]["equal"]


def test_a_step_in_backward_reads_one_flag_on_the_host(results):
    for got in results:
        for counts in got["syncs"]:
            assert counts == {"non-finite check (after the step is queued)": 1}, counts


def test_param_read_ahead_is_exact_bounded_and_never_stale(results):
    for got in results:
        p = got["prefetch"]
        assert p["equal"]
        assert p["ahead"]["hits"] > 0 and 1 <= p["ahead"]["peak"] <= 3
        assert p["ahead"]["left"] <= 3
        budget = p["byte-budget"]
        assert budget["hits"] > 0 and budget["peak_numel"] <= budget["budget"]
        assert p["none"]["hits"] == 0 and p["none"]["peak"] == 0
        assert p["stale"] == {"read_ahead": True, "fresh": True}
        assert p["ledger"][0] == p["ledger"][1]
