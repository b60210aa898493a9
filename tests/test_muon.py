"""Muon (DeepSpeed's `"optimizer": {"type": "Muon"}`) on shards equals a single-process Muon.

The reference below is written here, on whole tensors, from the update rule alone: matrices
(>= 2-D, no "embed" / "lm_head" in the name) get momentum, a Nesterov blend and five plain
Newton-Schulz steps in fp32; the rest gets AdamW; the clip factor comes from the norm over the
Muon updates and the Adam gradients. Sharded runs use `zeroshard_ns_dtype: fp32` so that the only
difference left is the order of fp32 sums (gradient averaging), hence 1e-5 relative.

One world of 2 ranks and one of 3 (uneven shards); in each, stages 0-3 with accumulation,
clipping, weight decay, both Newton-Schulz methods; the momentum of each matrix exists on exactly
one rank (stages 1-3), the memory ledger counts it, the comm ledger counts the two all-to-alls;
a checkpoint resumes exactly at world 2 and reshards to world 3 (and stage 3).
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

import zeroshard
from zeroshard.checkpoint import CheckpointError
from zeroshard.config.schema import ConfigError, load_config
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

GLOBAL = 12  # the same global batch at world 2 and world 3 (with or without accumulation)
STEPS = 4
HP = {"muon_lr": 0.02, "adam_lr": 0.01, "momentum": 0.9, "weight_decay": 0.05}
CASES = [
    dict(stage=0, gas=1, clip=0.0, method="standard", bucket=100),
    dict(stage=1, gas=2, clip=0.0, method="standard", bucket=1200),
    dict(stage=2, gas=1, clip=0.3, method="standard", bucket=100),   # clipping active
    dict(stage=2, gas=1, clip=0.0, method="gram", bucket=1200),
    dict(stage=3, gas=1, clip=0.3, method="gram", bucket=100),
    # Optimizer offload: the momentum in host memory, Newton-Schulz on the compute device.
    dict(stage=2, gas=1, clip=0.3, method="gram", bucket=100, offload="cpu"),
    dict(stage=3, gas=2, clip=0.0, method="gram", bucket=100, offload="nvme"),
]
MATRICES = {"block1.1.weight": 507, "block1.3.weight": 507, "block2.1.weight": 338,
            "block2.3.weight": 338}


def case_id(case: dict) -> str:
    """Readable pytest id."""
    return "-".join(f"{k}{v}" for k, v in case.items())


# -- the independent single-process reference ------------------------------------------------------
def _newton_schulz(x: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@functools.lru_cache(maxsize=None)
def reference(clip: float, skip: int = 0) -> dict[str, torch.Tensor]:
    """Muon + AdamW (betas 0.9/0.95, eps 1e-10) on the whole model and the whole global batch
    (without the first `skip` batches)."""
    batches, hp = make_batches(STEPS, GLOBAL)[skip:], HP
    model = make_model()
    params = dict(model.named_parameters())
    muon = {n for n, p in params.items()
            if p.dim() >= 2 and "embed" not in n and "lm_head" not in n}
    momentum = {n: torch.zeros_like(params[n]) for n in muon}
    m1 = {n: torch.zeros_like(p) for n, p in params.items() if n not in muon}
    m2 = {n: torch.zeros_like(p) for n, p in params.items() if n not in muon}
    beta, (b1, b2), eps = hp["momentum"], (0.9, 0.95), 1e-10
    for t, (tokens, targets) in enumerate(batches, start=1):
        model.zero_grad()
        lm_loss(model(tokens), targets).backward()
        with torch.no_grad():
            step = {}
            for n, p in params.items():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                if n in muon:
                    momentum[n] = beta * momentum[n] + (1 - beta) * g
                    blend = (1 - beta) * g + beta * momentum[n]
                    rows, cols = p.shape
                    step[n] = _newton_schulz(blend) * math.sqrt(max(1.0, rows / cols))
                else:
                    step[n] = g
            norm = torch.sqrt(sum(s.double().pow(2).sum() for s in step.values())).item()
            factor = clip / (norm + 1e-6) if 0 < clip < norm else 1.0
            for n, p in params.items():
                s = step[n] * factor
                if n in muon:
                    p.mul_(1 - hp["muon_lr"] * hp["weight_decay"]).sub_(hp["muon_lr"] * s)
                else:
                    m1[n] = b1 * m1[n] + (1 - b1) * s
                    m2[n] = b2 * m2[n] + (1 - b2) * s * s
                    denom = (m2[n] / (1 - b2 ** t)).sqrt() + eps
                    p.mul_(1 - hp["adam_lr"] * hp["weight_decay"])
                    p.sub_(hp["adam_lr"] * (m1[n] / (1 - b1 ** t)) / denom)
    return {n: p.detach().clone() for n, p in params.items()}


# -- the sharded runs ------------------------------------------------------------------------------
def _config(stage, world, gas=1, clip=0.0, method="gram", bucket=100, offload=None, root=None):
    micro = GLOBAL // world // gas
    zero = {"stage": stage, "reduce_bucket_size": bucket}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload is not None:
        zero["offload_optimizer"] = {"device": offload, "nvme_path": os.path.join(root, "swap")}
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "zero_optimization": zero,
            "optimizer": {"type": "Muon", "params": {**HP, "ns_method": method,
                                                     "zeroshard_ns_dtype": "fp32"}}}


def _train(engine, batches, rank, world):
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    for batch in batches:
        for k in range(gas):
            tokens, targets = micro_slice(batch, k, rank, world, micro)
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()


def _full_params(engine, model) -> dict[str, torch.Tensor]:
    with zeroshard.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _ledgers(engine) -> dict:
    """What this rank holds of Muon's state and what it moved, against what the plan predicts."""
    opt = engine.optimizer
    muon = opt.muon
    # Sent: the pieces held here of other ranks' matrices (collect), and the pieces other ranks
    # hold of this rank's matrices (their updates, returned); fp32, once per step each.
    sent = sum(e - s for m in muon.matrices for r, s, e in m.pieces
               if (r == muon.rank) != (m.owner == muon.rank)) if muon.sharded else 0
    adam_state = sum(t.numel() * t.element_size() for st in opt.optimizer.state.values()
                     for t in st.values() if torch.is_tensor(t))
    return {"momentum": sorted(muon.matrices[i].name for i in muon.momentum),
            "momentum_bytes": sum(t.numel() * t.element_size() for t in muon.momentum.values()),
            "optimizer_bytes": engine.memory_report()["optimizer"],
            "adam_state_bytes": adam_state,
            "all_to_all": engine.comm_report()["all_to_all"],
            "predicted_all_to_all": 4 * sent,
            "owners": {m.name: m.owner for m in muon.matrices},
            "groups": [(g["name"], g["use_muon"], g["lr"]) for g in opt.param_groups]}


def _run_case(rank, world, case, root):
    batches = make_batches(STEPS, GLOBAL)
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(world=world, root=root,
                                                                        **case))
    engine.comm.reset()
    _train(engine, batches, rank, world)
    out = {"params": _full_params(engine, model), **_ledgers(engine)}
    out["all_to_all"] //= STEPS
    engine.destroy()
    return out


def _checkpoint_save(rank, world, root):
    """World 2, stage 2: two steps, save, two more; a fresh engine loads and does the same two."""
    batches = make_batches(STEPS, GLOBAL)
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(2, world, clip=0.3))
    assert engine.optimizer.muon.entries(lambda *a: a) == {}  # nothing to save before a step
    _train(engine, batches[:2], rank, world)
    engine.save_checkpoint(root, tag="muon")
    _train(engine, batches[2:], rank, world)
    straight = _full_params(engine, model)
    engine.destroy()
    model = make_model(seed=5)  # other initial weights: everything must come from the checkpoint
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(2, world, clip=0.3))
    engine.load_checkpoint(root, tag="muon")
    _train(engine, batches[2:], rank, world)
    resumed = _full_params(engine, model)
    engine.destroy()
    # Into AdamW (one param group, not Muon's two): the state is refused by name; weights load.
    config = _config(2, world)
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    model = make_model(seed=5)
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    try:
        engine.load_checkpoint(root, tag="muon")
        refused = None
    except CheckpointError as err:
        refused = str(err)
    engine.load_checkpoint(root, tag="muon", load_optimizer_states=False)
    engine.destroy()
    return max((straight[n] - resumed[n]).abs().max().item() for n in straight), refused


def _checkpoint_reshard(rank, world, root, stage):
    """The world-2 stage-2 checkpoint, loaded at this world size and `stage`, trained on."""
    batches = make_batches(STEPS, GLOBAL)
    model = make_model(seed=5)
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(stage, world, clip=0.3))
    engine.load_checkpoint(root, tag="muon")
    owned = sorted(engine.optimizer.muon.matrices[i].name for i in engine.optimizer.muon.momentum)
    _train(engine, batches[2:], rank, world)
    params = _full_params(engine, model)
    engine.destroy()
    return params, owned


def _fp16(rank, world):
    """fp16 from a loss scale so large that the first steps overflow: they are skipped and leave
    the momentum as it was (none yet); the steps after them equal the reference from there."""
    model = make_model()
    config = _config(2, world, clip=0.3)
    config["fp16"] = {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    batches = make_batches(STEPS, GLOBAL)
    _train(engine, batches[:1], rank, world)
    muon = engine.optimizer.muon
    first = (engine.skipped_steps, muon.started, len(muon.momentum))
    _train(engine, batches[1:], rank, world)
    out = {"first": first, "skipped": engine.skipped_steps,
           "params": {n: p.float() for n, p in _full_params(engine, model).items()}}
    engine.destroy()
    return out


def _world(rank, world, root):
    results = {case_id(c): _run_case(rank, world, c, root) for c in CASES}
    if world == 2:
        results["fp16"] = _fp16(rank, world)
        results["ckpt"] = _checkpoint_save(rank, world, root)
    else:
        results["reshard"] = {s: _checkpoint_reshard(rank, world, root, s) for s in (1, 3)}
    return results


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    """Where world 2 saves the checkpoint world 3 reshards."""
    return str(tmp_path_factory.mktemp("muon_ckpt"))


@pytest.fixture(scope="module")
def world2(ckpt_root):
    """Every case on 2 ranks."""
    return run_world(2, _world, ckpt_root)


@pytest.fixture(scope="module")
def world3(world2, ckpt_root):
    """Every case on 3 ranks (after world 2 wrote its checkpoint)."""
    return run_world(3, _world, ckpt_root)


@pytest.fixture(scope="module")
def worlds(world2, world3):
    """Both worlds' per-rank results by world size."""
    return {2: world2, 3: world3}


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_parameters_equal_a_single_process_muon(worlds, world, case):
    ref = reference(case["clip"])
    for rank, results in enumerate(worlds[world]):
        errors = _rel_error_of(results[case_id(case)]["params"], ref)
        bad = {n: e for n, e in errors.items() if e > 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def _rel_error_of(params, ref) -> dict[str, float]:
    """Per parameter: max |difference| / max |reference value|."""
    return {n: (p - ref[n]).abs().max().item() / max(ref[n].abs().max().item(), 1e-12)
            for n, p in params.items()}


@pytest.mark.parametrize("world", (2, 3))
def test_each_matrix_momentum_lives_on_exactly_one_rank(worlds, world):
    for case in CASES:
        ranks = worlds[world]
        results = [r[case_id(case)] for r in ranks]
        names = sorted(results[0]["owners"])
        assert names == ["block1.1.weight", "block1.3.weight", "block2.1.weight",
                         "block2.3.weight"]
        held = [n for r in results for n in r["momentum"]]
        if case["stage"] == 0:  # replicated, as all of stage 0's optimizer state
            assert all(r["momentum"] == names for r in results)
            continue
        assert sorted(held) == names, (case, held)
        for rank, r in enumerate(results):
            assert r["momentum"] == sorted(n for n, o in r["owners"].items() if o == rank)
            assert r["momentum_bytes"] == 4 * sum(MATRICES[n] for n in r["momentum"])
            # The memory ledger: Adam's shard state plus the whole momentum of owned matrices
            # (under offload in CPU memory, beside the masters and Adam's state).
            if case.get("offload") is None:
                assert r["optimizer_bytes"]["device"] == r["adam_state_bytes"] + r["momentum_bytes"]
            else:
                assert r["optimizer_bytes"]["device"] == 0
                assert r["optimizer_bytes"]["cpu"] >= r["momentum_bytes"]
        loads = [r["momentum_bytes"] for r in results]
        assert max(loads) - min(loads) <= 4 * 507, loads  # balanced by numel


@pytest.mark.parametrize("world", (2, 3))
def test_comm_ledger_counts_the_two_all_to_alls(worlds, world):
    for case in CASES:
        for r in (rank[case_id(case)] for rank in worlds[world]):
            assert r["all_to_all"] == r["predicted_all_to_all"], case
            if case["stage"] > 0:
                assert r["all_to_all"] > 0
        # Far less than gathering every matrix on every rank (1690 elements each way).
        total = sum(rank[case_id(case)]["all_to_all"] for rank in worlds[world])
        assert total <= 2 * 4 * 1690


def test_param_groups_follow_deepspeeds_split(world2):
    groups = world2[0][case_id(CASES[1])]["groups"]
    assert groups == [("muon-params", True, 0.02), ("adam-params", False, 0.01)]


def test_fp16_overflow_skips_the_step_and_leaves_the_momentum(world2):
    for r in world2:
        skipped, started, held = r["fp16"]["first"]
        assert (skipped, started, held) == (1, False, 0)
    skipped = world2[0]["fp16"]["skipped"]
    assert 1 <= skipped < STEPS
    ref = reference(0.3, skip=skipped)
    bad = {n: e for n, e in _rel_error_of(world2[0]["fp16"]["params"], ref).items() if e > 1e-2}
    assert not bad, bad


def test_checkpoint_resumes_exactly(world2):
    assert all(r["ckpt"][0] == 0.0 for r in world2)


def test_muon_state_into_another_optimizer_is_refused_by_name(world2):
    for r in world2:
        assert "MuonWithAuxAdam) has 2 param group(s), this engine's (AdamW) 1" in r["ckpt"][1]
        assert "load_optimizer_states=False" in r["ckpt"][1]


@pytest.mark.parametrize("stage", (1, 3))
def test_checkpoint_reshards_to_three_ranks(world3, stage):
    ref = reference(0.3)
    owned = []
    for rank, results in enumerate(world3):
        params, mine = results["reshard"][stage]
        owned += mine
        bad = {n: e for n, e in _rel_error_of(params, ref).items() if e > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
    assert len(owned) == 4 and len(set(owned)) == 4


# -- in one process ------------------------------------------------------------------------------
def test_a_misspelt_muon_key_is_named():
    with pytest.raises(ConfigError, match=r"optimizer\.params\.momentun.*did you mean 'momentum'"):
        load_config({"optimizer": {"type": "Muon", "params": {"momentun": 0.9}}})
    with pytest.raises(ConfigError, match=r"ns_method.*\"gram\" or \"standard\""):
        load_config({"optimizer": {"type": "muon", "params": {"ns_method": "svd"}}})
    with pytest.raises(ConfigError, match=r"per_head_muon = true.*not supported yet"):
        load_config({"optimizer": {"type": "Muon", "params": {"per_head_muon": True}}})
    with pytest.raises(ConfigError, match=r"optimizer\.params\.momentum = 1.*below 1"):
        load_config({"optimizer": {"type": "Muon", "params": {"momentum": 1}}})
    cfg = load_config({"optimizer": {"type": "muon", "params": {"lr": 1e-3, "adam_lr": 1e-4}}})
    assert cfg.optimizer.type == "Muon"


def test_config_muon_defaults_and_learning_rates():
    from zeroshard.core.optim import build_optimizer

    model = make_model()
    cfg = load_config({"optimizer": {"type": "Muon", "params": {"lr": 1e-3, "adam_lr": 1e-4}}})
    opt = build_optimizer(cfg.optimizer, list(model.parameters()), model)
    muon, adam = opt.param_groups
    assert (muon["lr"], muon["momentum"], muon["weight_decay"], muon["ns_method"]) == \
        (1e-3, 0.95, 0.0, "gram")
    assert (adam["lr"], tuple(adam["betas"]), adam["eps"]) == (1e-4, (0.9, 0.95), 1e-10)
    assert {id(p) for p in muon["params"]} == {
        id(p) for n, p in model.named_parameters() if n.endswith(("1.weight", "3.weight"))}


def test_torch_muon_instance_is_refused_with_the_way_out():
    from zeroshard.config.refusals import check_elementwise

    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch has no Muon")
    model = make_model()
    with pytest.raises(ValueError, match=r'"type": "Muon"'):
        check_elementwise(torch.optim.Muon([model.block1[1].weight]))


def test_whole_tensor_step_equals_the_reference():
    """Outside zeroshard (whole parameters), MuonWithAuxAdam runs Muon itself (DeepSpeed's
    stage-0 behaviour); standard Newton-Schulz in fp32 equals the reference."""
    from zeroshard.core.muon import MuonWithAuxAdam, muon_param_groups

    batches = make_batches(STEPS, GLOBAL)
    model = make_model()
    hp = {"lr": HP["muon_lr"], "momentum": HP["momentum"], "weight_decay": HP["weight_decay"],
          "ns_method": "standard"}
    groups = muon_param_groups(model, model.parameters(), hp)
    groups[1].update(lr=HP["adam_lr"])
    opt = MuonWithAuxAdam(groups, ns_dtype="fp32")
    for tokens, targets in batches:
        opt.zero_grad()
        lm_loss(model(tokens), targets).backward()
        opt.step()
    errors = _rel_error_of({n: p.detach() for n, p in model.named_parameters()}, reference(0.0))
    assert max(errors.values()) < 1e-5, errors


def test_newton_schulz_methods_agree_in_fp32():
    from zeroshard.core.muon import orthogonalize

    torch.manual_seed(0)
    for shape in [(39, 13), (13, 26), (16, 16), (3, 8, 20)]:
        g = torch.randn(shape)
        standard = orthogonalize(g, "standard", torch.float32)
        gram = orthogonalize(g, "gram", torch.float32)
        assert (standard - gram).abs().max() < 1e-5
        if g.dim() == 2:
            assert torch.allclose(standard, _newton_schulz(g), atol=1e-6)
            sv = torch.linalg.svdvals(standard)
            assert 0.6 < sv.min() and sv.max() < 1.25  # Muon's approximately orthogonal range


def test_ns_dtype_follows_deepspeeds_rule():
    from zeroshard.core.muon import ns_dtype

    cpu = torch.device("cpu")
    assert ns_dtype("standard", cpu) == torch.bfloat16
    fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert ns_dtype("gram", cpu) == (torch.float16 if fp16 else torch.float32)
    assert ns_dtype("gram", cpu, "fp32") == torch.float32
    assert os.environ.get("ZEROSHARD_STRICT_HOST") == "1"  # the worlds above ran strict
