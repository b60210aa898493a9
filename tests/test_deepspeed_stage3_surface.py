"""Stage-3 behaviours DeepSpeed users and libraries rely on (DeepSpeed 0.19.8's own tests are the
specification: test_zero_leaf_module, test_zero_context(_return), test_zero_late_module_attach,
test_zero_linear_direct_init, test_zero_grad_clip).

Single process: the leaf-module marks (by class, subclass, class name, qualified name, module name,
name suffix; no match; unset) and the `zero_optimization.leaf_module` config section.

One world of two ranks, every case against a single-process reference of the same global batch:
a leaf root whose ranks run different layers, an experts list made a leaf by the config, a
parameter read in another module's forward and one returned from a forward (found without
register_external_parameter), a module attached after initialize, this rank's gradient piece
read and rewritten between backward and step, and a Linear's weight released between its forward
and its backward.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.harness import run_world
from zeroshard.compat.deepspeed import alias
from zeroshard.compat.deepspeed.utils import (get_z3_leaf_modules, safe_get_full_fp32_param,
                                              safe_get_full_grad, safe_get_local_grad,
                                              safe_set_local_grad, set_z3_leaf_modules,
                                              set_z3_leaf_modules_by_name,
                                              set_z3_leaf_modules_by_suffix,
                                              unset_z3_leaf_modules, z3_leaf_module)
from zeroshard.compat.deepspeed.zero_config import DeepSpeedZeroConfig
from zeroshard.config.leaf_module import DEFAULT_LEAF_MODULE_CLASSES
from zeroshard.config.schema import load_config
from zeroshard.core.layout import ZeroParamStatus

STEPS = 3
WORLD = 2
DIM = 8


# -- models -----------------------------------------------------------------------------------------

class Base(nn.Module):
    """A class the leaf marks can name instead of its subclass."""


class Leaf(Base):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.proj(x)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = Leaf()
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, x):
        return self.child(x)


class RankChoice(nn.Module):
    """Each rank runs a different layer (`which`): only a leaf root keeps the ranks' gathers alike."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.out = nn.Linear(DIM, 4)

    def forward(self, x, which):
        return self.out(torch.relu(self.layers[which](x)))


class TinyMoE(nn.Module):
    """A gate and two experts; each rank routes to another expert (data-dependent order)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, 2)
        self.experts = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.head = nn.Linear(DIM, 4)

    def forward(self, x, which):
        weight = self.gate(x).softmax(-1)[:, which:which + 1]
        return self.head(self.experts[which](x) * weight)


class ExtRead(nn.Module):
    """The root's forward uses linear1's weight directly (DeepSpeed's test_ext_param_getattr)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(DIM, DIM)
        self.linear2 = nn.Linear(DIM, DIM)

    def forward(self, x, which=0):
        h = self.linear2(self.linear1(x))
        out = F.linear(h, self.linear1.weight)
        # Attached after initialize (the late-module case): a new layer, and one whose weight
        # is linear2's (sharded, so it must be gathered when the late layer reads it).
        late, tied = self._modules.get("late"), self._modules.get("late_tied")
        if tied is not None:
            out = out + tied(out)
        return late(out) if late is not None else out


class ReturnsBias(nn.Linear):
    def forward(self, x):
        return super().forward(x), self.bias


class Dangler(nn.Linear):
    def __init__(self):
        super().__init__(DIM, DIM)
        self.inner = ReturnsBias(DIM, DIM)

    def forward(self, x):
        out, bias = self.inner(super().forward(x))
        return out, bias  # the inner module's bias, handed on to the caller


class Container(nn.Module):
    """Adds a bias it got back from a submodule (DeepSpeed's test_zero_context_return)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(DIM, DIM)
        self.dangler = Dangler()

    def forward(self, x):
        out, bias = self.dangler(self.linear1(x))
        return out + bias


class Returns(nn.Module):
    def __init__(self):
        super().__init__()
        self.container = Container()

    def forward(self, x, which=0):
        return self.container(x)


# -- single process ---------------------------------------------------------------------------------

def test_leaf_marks_by_class_subclass_and_names():
    model = Wrapper()
    qualified = f"{Leaf.__module__}.{Leaf.__qualname__}"
    for classes in ([Leaf], ["Leaf"], [qualified], [Base]):
        unset_z3_leaf_modules(model, [Leaf])
        assert set_z3_leaf_modules(model, classes) == [model.child], classes
        assert z3_leaf_module(model.child) and not z3_leaf_module(model)
    # A name matches the class itself, not its bases (as in DeepSpeed).
    assert set_z3_leaf_modules(model, ["Base"], raise_if_not_found=False) == []
    assert unset_z3_leaf_modules(model, [Leaf]) == [model.child] and get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match=r"no module of class \['Conv2d'\] in Wrapper"):
        set_z3_leaf_modules(model, [nn.Conv2d])
    with pytest.raises(ValueError, match="unset_z3_leaf_modules: no module of class"):
        unset_z3_leaf_modules(model, ["Conv2d"])
    with pytest.raises(TypeError, match="classes or class names"):
        set_z3_leaf_modules(model, [3])
    assert set_z3_leaf_modules(model, [nn.ModuleList]) == [model.experts]  # a container too


def test_leaf_marks_by_module_name_and_suffix():
    model = Wrapper()
    assert set_z3_leaf_modules_by_name(model, ["child"]) == ([model.child], [])
    assert set_z3_leaf_modules_by_name(model, ["child", "nope"], raise_if_not_found=False) == \
        ([model.child], ["nope"])
    with pytest.raises(ValueError, match=r"no module named \['nope'\]"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    found, missing = set_z3_leaf_modules_by_suffix(model, ["0", "1", "child", "zzz"],
                                                   raise_if_not_found=False)
    assert found == [model.experts[0], model.experts[1], model.child] and missing == ["zzz"]
    found, _ = set_z3_leaf_modules_by_suffix(model, ["experts", "experts"], flag=False)
    assert found == [model.experts] and not z3_leaf_module(model.experts)
    with pytest.raises(ValueError, match=r"ends with \['zzz'\]"):
        set_z3_leaf_modules_by_suffix(model, ["zzz"])


def test_leaf_module_config_section(caplog):
    cfg = DeepSpeedZeroConfig()
    assert cfg.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES
    assert cfg.leaf_module.names == [] and cfg.leaf_module.name_suffixes == []
    cfg = DeepSpeedZeroConfig(stage=3, leaf_module={"classes": "my.Class", "names": ["a", "a"],
                                                    "name_suffixes": "experts"})
    assert (cfg.leaf_module.classes, cfg.leaf_module.names, cfg.leaf_module.name_suffixes) == \
        (["my.Class"], ["a"], ["experts"])
    block = {"stage": 3, "leaf_module": {"name_suffixes": ["experts"]}}
    loaded = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": block})
    again = load_config(loaded.to_dict())
    assert again.zero_optimization.leaf_module == loaded.zero_optimization.leaf_module
    with pytest.raises(ValueError, match="did you mean 'classes'"):
        load_config({"zero_optimization": {"stage": 3, "leaf_module": {"clases": ["X"]}}})
    with pytest.raises(ValueError, match="list of strings"):
        load_config({"zero_optimization": {"stage": 3, "leaf_module": {"names": [1]}}})
    with pytest.warns(UserWarning, match="leaf_module only applies to ZeRO stage 3"):
        load_config({"zero_optimization": {"stage": 2, "leaf_module": {"names": ["x"]}}})
    # Applied as initialize() applies it: names that match nothing are reported, not fatal.
    from zeroshard.core.leaf import apply_leaf_module_config

    model = Wrapper()
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        marked = apply_leaf_module_config(model, DeepSpeedZeroConfig(leaf_module={
            "names": ["child", "ghost"], "name_suffixes": ["experts"]}).leaf_module)
    assert marked == [model.child, model.experts] and "ghost" in caplog.text


def test_deepspeed_utils_leaf_function_is_not_its_module():
    """`from deepspeed.utils import z3_leaf_module` is the function, as DeepSpeed's package
    re-exports it over its submodule's name, also after the submodule itself was imported."""
    target = importlib.import_module("zeroshard.compat.deepspeed.utils")
    module = alias.DeepSpeedModule("deepspeed.utils", target)
    assert module.z3_leaf_module is z3_leaf_module
    module.z3_leaf_module = importlib.import_module("zeroshard.compat.deepspeed.utils.z3_leaf")
    assert module.z3_leaf_module is z3_leaf_module
    assert alias.ALIASES["deepspeed.runtime.zero.leaf_module_config"] == "zeroshard.config.leaf_module"


# -- two ranks --------------------------------------------------------------------------------------

def _config(**zero):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": 0,
                                  "stage3_prefetch_bucket_size": 0, **zero}}


def _data(step: int, rank: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, DIM, generator=gen), torch.randn(4, 4, generator=gen)


def _loss(model, step: int, rank: int):
    x, y = _data(step, rank)
    out = model(x, rank % 2)
    return (out[..., :y.shape[-1]] - y).pow(2).mean()


def _reference(make, steps=STEPS, scale_grads: float = 1.0):
    """Plain SGD on the mean of every rank's loss: what the engine's averaged gradients give."""
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        loss = sum(_loss(model, step, r) for r in range(WORLD)) / WORLD
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale_grads)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _error(model, ref) -> float:
    return max(((p.detach() - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)).item()
               for n, p in model.named_parameters())


def _seeded(cls, mark=None):
    def make():
        torch.manual_seed(3)
        model = cls()
        if mark is not None:
            mark(model)
        return model
    return make


def _train(make, config, rank, steps=STEPS, between=None):
    model = make()
    engine, *_ = zeroshard.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(steps):
        engine.backward(_loss(engine, step, rank))
        if between is not None:
            between(engine)
        engine.step()
    return engine, model


def _released(engine) -> bool:
    policy = engine.optimizer.policy
    return all(not policy.by_index[i].is_gathered for i in policy.sharded)


def _leaf_root(rank, world):
    make = _seeded(RankChoice, lambda m: set_z3_leaf_modules(m, [RankChoice]))
    engine, model = _train(make, _config(), rank)
    owners = {u.owner for u in engine.optimizer.units}
    released = _released(engine)
    engine.destroy()
    return {"err": _error(model, _reference(make)), "owners": owners, "released": released}


def _leaf_config(rank, world):
    make = _seeded(TinyMoE)
    engine, model = _train(make, _config(leaf_module={"name_suffixes": ["experts"]}), rank)
    experts = next(u for u in engine.optimizer.units if u.owner == "experts")
    whole = {id(p) for p in model.experts.parameters()} == {id(p) for p in experts.params()}
    marked = z3_leaf_module(model.experts)
    released = _released(engine)
    engine.destroy()
    return {"err": _error(model, _reference(make)), "whole": whole, "marked": marked,
            "released": released}


def _external_read(rank, world):
    make = _seeded(ExtRead)
    engine, model = _train(make, _config(), rank)
    found = [p is model.linear1.weight for p in model._external_params.values()]
    released = _released(engine)
    engine.destroy()
    return {"err": _error(model, _reference(make)), "found": found, "released": released}


def _returned(rank, world):
    make = _seeded(Returns)
    engine, model = _train(make, _config(), rank)
    counts = [len(m._external_params) for m in (model, model.container, model.container.dangler,
                                                model.container.dangler.inner)]
    covered = next(iter(model.container._external_params.values())) is \
        model.container.dangler.inner.bias
    released = _released(engine)
    engine.destroy()
    return {"err": _error(model, _reference(make)), "counts": counts, "covered": covered,
            "released": released}


def _late_module(rank, world):
    make = _seeded(ExtRead)
    model = make()
    engine, *_ = zeroshard.initialize(model=model, config=_config(),
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(11)
    late = nn.Linear(DIM, DIM)
    before = late.weight.detach().clone()
    model.late = late  # after initialize: run whole, never partitioned, not in the optimizer
    model.late_tied = nn.Linear(DIM, DIM, bias=False)
    model.late_tied.weight = model.linear2.weight
    x, _ = _data(0, rank)
    with torch.no_grad():
        first, second = engine(x), engine(x)
        with zeroshard.GatheredParameters(list(model.linear1.parameters()) +
                                          list(model.linear2.parameters())):
            h = F.linear(model.linear2(model.linear1(x)), model.linear1.weight)
            expected = late(h + F.linear(h, model.linear2.weight))
    for step in range(2):
        engine.backward(_loss(engine, step, rank))
        engine.step()
    result = {"same": torch.equal(first, second), "err": (first - expected).abs().max().item(),
              "whole": late.weight.numel() == DIM * DIM,
              "untouched": torch.equal(late.weight.detach(), before),
              "released": _released(engine)}
    engine.destroy()
    return result


def _local_grads(rank, world):
    """Halving every rank's gradient piece between backward and step trains as halved gradients
    do; the step's norm is the norm of what was written."""
    make = _seeded(ExtRead)
    pieces, norms = [], []

    def halve(engine):
        for param in engine.module.parameters():
            piece = safe_get_local_grad(param)
            pieces.append(piece.numel())
            safe_set_local_grad(param, piece * 0.5)
        norms.append(sum(safe_get_full_grad(p).pow(2).sum() for p in engine.module.parameters()))

    engine, model = _train(make, _config(), rank, between=halve)
    norm = engine.get_global_grad_norm()
    with pytest.raises(ValueError, match="got 3 values for a piece of"):
        safe_set_local_grad(model.linear1.weight, torch.zeros(3))
    engine.destroy()
    return {"err": _error(model, _reference(make, scale_grads=0.5)), "pieces": pieces,
            "norm": (float(norm), float(norms[-1]) ** 0.5)}


def _linear_released(rank, world):
    """A Linear's weight is freed between its forward and its backward (DeepSpeed's
    memory_efficient_linear), and its gradient and step are the reference's."""
    torch.manual_seed(5)
    model = nn.Linear(4, 3)
    reference = nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    engine, *_ = zeroshard.initialize(model=model, config=_config(memory_efficient_linear=True),
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    xs = [torch.arange(8, dtype=torch.float32).reshape(2, 4) / (8 + r) for r in range(WORLD)]
    sum(reference(x).sum() for x in xs).div(WORLD).backward()
    out = engine(xs[rank])
    between = (model.weight.ds_status, model.weight.numel())
    engine.backward(out.sum())
    grads = (safe_get_full_grad(model.weight) - reference.weight.grad).abs().max().item(), \
        (safe_get_full_grad(model.bias) - reference.bias.grad).abs().max().item()
    before = safe_get_full_fp32_param(model.weight).clone()
    engine.step()
    moved = not torch.equal(before, safe_get_full_fp32_param(model.weight))
    engine.destroy()
    return {"between": between, "grads": grads, "moved": moved}


CASES = {"leaf_root": _leaf_root, "leaf_config": _leaf_config, "external_read": _external_read,
         "returned": _returned, "late_module": _late_module, "local_grads": _local_grads,
         "linear_released": _linear_released}


def _all_cases(rank, world):
    return {name: case(rank, world) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def world():
    """Per-rank {case: result} from one world of two ranks."""
    return run_world(WORLD, _all_cases)


def _each(world, case):
    return [results[case] for results in world]


def test_leaf_root_keeps_ranks_running_different_layers_in_step(world):
    for got in _each(world, "leaf_root"):
        assert got["err"] < 1e-5
        assert got["owners"] == {"<root>"}, "a leaf root is one unit"
        assert got["released"]


def test_config_leaf_experts_are_one_unit_gathered_whole(world):
    for got in _each(world, "leaf_config"):
        assert got["marked"] and got["whole"]
        assert got["err"] < 1e-5 and got["released"]


def test_parameter_read_in_another_forward_is_found(world):
    for got in _each(world, "external_read"):
        assert got["found"] == [True]
        assert got["err"] < 1e-5 and got["released"]


def test_returned_parameter_is_covered_by_the_caller(world):
    for got in _each(world, "returned"):
        assert got["counts"] == [0, 1, 0, 0] and got["covered"]
        assert got["err"] < 1e-5 and got["released"]


def test_modules_attached_after_initialize_run(world):
    for got in _each(world, "late_module"):
        assert got["same"] and got["err"] < 1e-6
        assert got["whole"] and got["untouched"] and got["released"]


def test_local_gradient_pieces_are_read_and_written_before_the_step(world):
    sizes = [got["pieces"] for got in _each(world, "local_grads")]
    # Each parameter's pieces on the two ranks add up to the parameter (DIM*DIM+DIM, twice).
    per_step = len(sizes[0]) // STEPS
    assert sum(sizes[0][:per_step]) + sum(sizes[1][:per_step]) == 2 * (DIM * DIM + DIM)
    for got in _each(world, "local_grads"):
        assert got["err"] < 1e-5
        norm, written = got["norm"]
        assert norm == pytest.approx(written, rel=1e-5)


def test_linear_weight_released_between_forward_and_backward(world):
    for got in _each(world, "linear_released"):
        assert got["between"] == (ZeroParamStatus.NOT_AVAILABLE, 0)
        assert max(got["grads"]) < 1e-6 and got["moved"]
