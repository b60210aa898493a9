"""bf16 master weights and optimizer state (DeepSpeed's bf16_master_weights_and_grads +
bf16_optimizer_states): the shard's masters and state are bf16, the memory ledger shows half the
optimizer bytes of fp32 masters (K = 6 instead of 12 with Adam, as `estimate` says), training
tracks the fp32 reference within bf16's precision, and the checkpoint loads into fp32 masters."""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice, reference_run
from zeroshard.sizing.estimate import model_states

STEPS, MICRO, PAD = 5, 2, 16
BF16_MASTER = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
RUNS = [(stage, offload) for stage in (1, 2, 3) for offload in ("none", "cpu")]


def _config(stage, offload, bf16):
    zero = {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "bf16": bf16,
            "zero_optimization": zero}


def _train(rank, world, config, batches, optimizer):
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer(model), config=config)
    for batch in batches:
        tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
    return model, engine


def _optimizer_bytes(engine) -> int:
    return sum(engine.memory_report()["optimizer"].values())


def _measure(rank, world, tmp):
    batches = make_batches(STEPS, MICRO * world)
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)  # noqa: E731
    ref = reference_run(sgd, batches)
    init = {n: p.detach().clone() for n, p in make_model().named_parameters()}
    out = {"psi": sum(p.numel() for p in init.values())}
    for stage, offload in RUNS:
        row = {}
        for name, bf16 in (("master", BF16_MASTER), ("fp32", {"enabled": True})):
            model, engine = _train(rank, world, _config(stage, offload, bf16), batches[:1], adam)
            report = engine.memory_report()["optimizer"]
            row[name] = {"bytes": _optimizer_bytes(engine), "where": {k for k, v in report.items() if v},
                         "units": len(engine.optimizer.units),
                         "master_dtypes": {m.dtype for m in engine.optimizer.masters},
                         "state_dtypes": {t.dtype for s in engine.optimizer.state.values()
                                          for t in s.values() if torch.is_tensor(t) and t.dim()}}
            engine.destroy()
        model, engine = _train(rank, world, _config(stage, offload, BF16_MASTER), batches, sgd)
        if (stage, offload) == (2, "none"):
            engine.save_checkpoint(tmp)
        engine.destroy()  # leaves a stage-3 model whole
        row["worst"] = max(((p.detach().float() - ref[n]).abs().max() / ref[n].abs().max()).item()
                           for n, p in model.named_parameters())
        row["moved"] = max(((init[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref)
        out[(stage, offload)] = row
    # A bf16-master checkpoint loads into fp32 masters (a bf16 run resumed without the keys).
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=sgd(model),
                                           config=_config(2, "none", {"enabled": True}))
    engine.load_checkpoint(tmp)
    saved = [m.detach().clone() for m in engine.optimizer.masters]
    out["loaded"] = all(m.dtype == torch.float32 for m in saved) and \
        all(torch.equal(m, m.bfloat16().float()) for m in saved) and any(m.abs().sum() > 0 for m in saved)
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bf16_master_ckpt"))
    return run_world(2, _measure, tmp)[0]


@pytest.mark.parametrize("stage,offload", RUNS)
def test_masters_and_state_are_bf16_and_half_the_bytes(measured, stage, offload):
    got = measured[(stage, offload)]
    assert got["master"]["master_dtypes"] == {torch.bfloat16}
    assert got["master"]["state_dtypes"] == {torch.bfloat16}
    assert got["fp32"]["master_dtypes"] == {torch.float32}
    place = "device" if offload == "none" else offload
    assert got["master"]["where"] == got["fp32"]["where"] == {place}
    # Ledger against the estimator's formula: K = 6 (bf16 master + bf16 m, v) per owned param.
    psi, world = measured["psi"], 2
    expected = model_states(psi, world, stage, "bf16-master", "adam", offload)["optimizer"][place]
    pad = 6 * world * PAD * got["master"]["units"] + 64
    assert expected - 1 <= got["master"]["bytes"] <= expected + pad, (got["master"]["bytes"], expected)
    assert expected == model_states(psi, world, stage, "bf16", "adam", offload)["optimizer"][place] / 2
    assert got["master"]["bytes"] == pytest.approx(got["fp32"]["bytes"] / 2, rel=0.05)


@pytest.mark.parametrize("stage,offload", RUNS)
def test_training_tracks_the_fp32_reference(measured, stage, offload):
    got = measured[(stage, offload)]
    assert got["worst"] < 3e-2, got["worst"]
    assert got["worst"] < got["moved"] / 5, (got["worst"], got["moved"])


def test_checkpoint_loads_into_fp32_masters(measured):
    assert measured["loaded"]


def test_estimate_shows_the_saving():
    """`zeroshard estimate --precision bf16-master`: K = 6 at stages 1-3, fp32 masters at stage 0."""
    bf16, master = (model_states(1e9, 8, 1, p)["optimizer"]["device"] for p in ("bf16", "bf16-master"))
    assert (bf16, master) == (12e9 / 8, 6e9 / 8)
    assert model_states(1e9, 8, 0, "bf16-master") == model_states(1e9, 8, 0, "bf16")
