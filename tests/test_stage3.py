"""Stage 3 equals the single-process reference (fp32, 1e-5 relative) at world sizes 1-4.

One world per size; inside it: accumulation x clipping x optimizer x gather schedule (lean: no
prefetch or reuse; prefetch: bounded prefetch and reuse), plus activation checkpointing, a module
called twice per forward, dict inputs/outputs, param groups, frozen parameters, persistent small
parameters, explicit unit classes (a tied weight then spans two units), a model built under
`zeroshard.Init`, an eval forward under no_grad, GatheredParameters / load_full_state_dict, and
the embedding (tied to the head) released while the blocks run, in forward and backward.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import zeroshard
from zeroshard.core.init import init_units
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice, reference_run
from tests.test_stages import OPTIMIZERS, _rel_error, case_id, frozen_block, two_groups

STEPS = 4
MICRO = 2
CLIP = 0.05
WORLDS = (1, 2, 3, 4)

MODES = {
    "lean": {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
             "stage3_prefetch_bucket_size": 0},
    "prefetch": {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000,
                 "stage3_max_live_parameters": 1600, "stage3_max_reuse_distance": 600},
}
GRID = [dict(gas=g, clip=c, opt=o, mode=m)
        for g, c, o, m in itertools.product((1, 3), (0.0, CLIP), OPTIMIZERS, MODES)]
EXTRA = [dict(kind=k) for k in ("ckpt_reentrant", "ckpt_plain", "reuse", "dict_io", "two_groups",
                                "frozen", "persist", "ds_defaults", "unit_classes", "init",
                                "eval", "gathered", "prepare", "root_split")]


def _config(gas=1, clip=0.0, mode="lean", **zero):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 100, **MODES[mode], **zero}}


def _train(engine, batches, rank, world, gas, dict_io=False):
    for batch in batches:
        for micro in range(gas):
            tokens, targets = micro_slice(batch, micro, rank, world, MICRO)
            out = engine(batch={"tokens": tokens}) if dict_io else engine(tokens)
            logits = out["logits"] if dict_io else out
            engine.backward(lm_loss(logits, targets))
            engine.step()


def _sharded_between_steps(engine) -> bool:
    """No sharded unit holds its full buffer between steps."""
    policy = engine.optimizer.policy
    return all(not policy.by_index[i].is_gathered for i in policy.sharded)


def _run_grid_case(rank, world, case):
    gas = case["gas"]
    batches = make_batches(STEPS, MICRO * gas * world)
    ref = reference_run(lambda m: OPTIMIZERS[case["opt"]](m.parameters()), batches, case["clip"])
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=OPTIMIZERS[case["opt"]](model.parameters()),
        config=_config(gas, case["clip"], case["mode"]))
    _train(engine, batches, rank, world, gas)
    assert engine.global_steps == STEPS
    assert _sharded_between_steps(engine)
    engine.destroy()  # leaves the model whole, for the comparison
    return _rel_error(model, ref)


def _run_extra_case(rank, world, kind):
    batches = make_batches(STEPS, MICRO * world)
    sgd = OPTIMIZERS["sgd"]
    options, zero, factory = {}, {}, lambda m: sgd(m.parameters())
    mode = "lean"
    if kind.startswith("ckpt_"):
        options["checkpoint"] = kind[len("ckpt_"):]
    elif kind == "reuse":
        options["reuse"] = True
        mode = "prefetch"
    elif kind in ("two_groups", "frozen"):
        factory = two_groups if kind == "two_groups" else frozen_block
    elif kind == "persist":
        zero["stage3_param_persistence_threshold"] = 40  # biases and norms stay whole
    elif kind == "ds_defaults":
        mode = "prefetch"
        zero = {k: v for k, v in ({"stage3_param_persistence_threshold": 100_000,
                                   "stage3_prefetch_bucket_size": 50_000_000,
                                   "stage3_max_live_parameters": 1_000_000_000,
                                   "stage3_max_reuse_distance": 1_000_000_000}).items()}
    elif kind == "unit_classes":
        # The head is a Linear whose weight the Embedding unit owns: a weight tied across units.
        zero["zeroshard_unit_classes"] = ["Linear", "Embedding", "LayerNorm"]
    ref = reference_run(factory, batches, **{k: v for k, v in options.items() if k == "reuse"})
    extra = {}
    if kind == "init":
        with zeroshard.Init(config=_config()):
            model = make_model()
            applied = ApplyInit()
            torch.manual_seed(7)  # MultiheadAttention zeroes out_proj.bias after building it
            encoder = torch.nn.TransformerEncoderLayer(16, 2, 32)
        trainable = sum(p.ds_numel for p in model.parameters())
        units = init_units(model)
        extra["init_empty"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        extra["init_share"] = (sum(u.shard.numel() for u in units), trainable, len(units))
        torch.manual_seed(7)
        normal_encoder = torch.nn.TransformerEncoderLayer(16, 2, 32)
        extra["init_equal"] = _same_as_normal(model, make_model()) and \
            _same_as_normal(applied, ApplyInit()) and _same_as_normal(encoder, normal_encoder)
    else:
        model = make_model(dict_io=kind == "dict_io", **options)
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=factory(model),
                                           config=_config(mode=mode, **zero))
    names_before = [n for n, _ in model.named_parameters()]
    if kind == "root_split":
        hooks = _watch_embedding(engine, model, extra)
    if kind == "prepare":  # the plain PyTorch loop: loss.backward(); opt.step(); opt.zero_grad()
        engine.destroy()
        model = make_model()
        model, optimizer = zeroshard.prepare(model, factory(model), _config())
        engine = optimizer.engine
        for batch in batches:
            tokens, targets = micro_slice(batch, 0, rank, world, MICRO)
            lm_loss(model(tokens), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        _train(engine, batches, rank, world, 1, dict_io=kind == "dict_io")
    extra["names_kept"] = names_before == [n for n, _ in model.named_parameters()] and \
        list(model.state_dict(keep_vars=True)) == list(make_model().state_dict())
    if kind == "eval":
        extra.update(_eval_checks(engine, model, ref, rank, world))
    if kind == "gathered":
        extra.update(_gathered_checks(engine, model, rank))
        ref = None
    if kind == "root_split":
        for hook in hooks:
            hook.remove()
    engine.destroy()
    return {"err": _rel_error(model, ref) if ref is not None else 0.0, **extra}


class ApplyInit(torch.nn.Module):
    """Re-initialises its layers with `self.apply` at the end of its constructor (nanoGPT-style)."""

    def __init__(self):
        torch.manual_seed(5)
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
            torch.nn.init.zeros_(module.bias)


def _same_as_normal(partitioned, normal) -> bool:
    """Gathered values of a model built under Init equal a normal build's, bit for bit."""
    with zeroshard.GatheredParameters(list(partitioned.parameters())):
        return all(torch.equal(p, q) for p, q in zip(partitioned.parameters(), normal.parameters()))


def _watch_embedding(engine, model, extra):
    """Record whether the embedding's unit (tied to the head) is gathered while the blocks run,
    in forward and in backward: never, in the lean mode (no reuse, no prefetch)."""
    unit = next(u for u in engine.optimizer.units if u.owner == "embed")
    forward, backward = [], []
    extra["embed_gathered"] = (forward, backward)
    return [model.block2.register_forward_pre_hook(lambda m, a: forward.append(unit.is_gathered)),
            model.block1.register_full_backward_pre_hook(
                lambda m, g: backward.append(unit.is_gathered))]


def _eval_checks(engine, model, ref, rank, world):
    """A no_grad eval forward on sharded parameters equals the reference model's, frees all."""
    tokens, targets = micro_slice(make_batches(1, MICRO * world, seed=9)[0], 0, rank, world, MICRO)
    reference = make_model()
    reference.load_state_dict(ref, strict=False)
    engine.eval()
    with torch.no_grad():
        loss = lm_loss(engine(tokens), targets).item()
        with engine.gathered_model():
            gathered_loss = lm_loss(engine(tokens), targets).item()
            whole = all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
        expected = lm_loss(reference(tokens), targets).item()
    engine.train()
    weight = model.block2[1].weight  # released: an empty tensor, real shape in ds_shape
    released = weight.numel() == 0 and tuple(weight.ds_shape) == (26, 13) and weight.ds_numel == 338
    return {"eval_loss": (loss, gathered_loss, expected), "eval_freed": _sharded_between_steps(engine),
            "gathered_whole": whole, "released": released}


def _gathered_checks(engine, model, rank):
    """GatheredParameters: modifier_rank's change is kept; without it changes are discarded;
    load_full_state_dict puts a full state dict back."""
    weight = model.block2[1].weight
    saved = {}
    with zeroshard.GatheredParameters(list(model.parameters())):
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    consolidated = engine.consolidated_state_dict(rank0_only=False)
    same = list(consolidated) == list(saved) and \
        all(torch.equal(consolidated[k], v) for k, v in saved.items())
    rank0 = engine._zero3_consolidated_16bit_state_dict()
    rank0_ok = (len(rank0) == len(saved)) if rank == 0 else rank0 == {}
    with pytest.warns(UserWarning, match="stage3_gather_16bit_weights_on_model_save"):
        rank0_ok &= engine.save_16bit_model("/nonexistent/never-written") is False
    with zeroshard.GatheredParameters(weight, modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    with zeroshard.GatheredParameters(weight):
        kept = bool((weight == 0.5).all())
        weight.data.fill_(-1.0)  # no modifier_rank: discarded on exit
    with zeroshard.GatheredParameters(weight):
        discarded = bool((weight == 0.5).all())
    zeroshard.load_full_state_dict(model, saved)
    with zeroshard.GatheredParameters(list(model.parameters())):
        restored = all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    return {"modifier_kept": kept, "unmodified_discarded": discarded, "restored": restored,
            "consolidated": same and rank0_ok}


def _all_cases(rank, world):
    out = {}
    for case in GRID:
        out[case_id(case)] = _run_grid_case(rank, world, case)
    for case in EXTRA:
        out[case_id(case)] = _run_extra_case(rank, world, case["kind"])
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"world{n}")
def world_results(request):
    """Per-rank {case id: result} for one world size."""
    return request.param, run_world(request.param, _all_cases)


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_stage3_matches_reference(world_results, case):
    world, results = world_results
    for rank, errors in enumerate(results):
        err = errors[case_id(case)]
        assert err < 1e-5, f"world {world} rank {rank}: max relative error {err:.2e}"


@pytest.mark.parametrize("case", EXTRA, ids=case_id)
def test_stage3_real_model_features(world_results, case):
    world, results = world_results
    for rank, got in enumerate(results):
        got = got[case_id(case)]
        assert got["err"] < 1e-5, f"world {world} rank {rank}: max relative error {got['err']:.2e}"
        assert got["names_kept"], "named_parameters()/state_dict() keys changed"
        if case["kind"] == "init":
            assert got["init_empty"], "a parameter kept its full storage after Init"
            shard, total, units = got["init_share"]
            # Each construction unit pads by fewer than 16 elements per rank.
            assert total / world <= shard <= total / world + 16 * units, (shard, total, units)
            assert got["init_equal"], "Init gave other initial values than a normal build"
        if case["kind"] == "eval":
            loss, gathered, expected = got["eval_loss"]
            assert loss == pytest.approx(expected, rel=1e-5)
            assert gathered == pytest.approx(expected, rel=1e-5)
            assert got["eval_freed"] and got["gathered_whole"] and got["released"]
        if case["kind"] == "root_split":
            forward, backward = got["embed_gathered"]
            assert len(forward) == len(backward) == STEPS
            assert not any(forward), "the embedding stayed gathered through the blocks' forward"
            assert not any(backward), "the tied embedding stayed gathered through the backward"
        if case["kind"] == "gathered":
            assert got["modifier_kept"] and got["unmodified_discarded"] and got["restored"]
            assert got["consolidated"], "consolidated_state_dict differs from the gathered model"
