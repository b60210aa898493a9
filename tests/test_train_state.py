"""The two DCP `Stateful`s a checkpoint goes through: `TrainState` round-trips the run's counters,
loss scaler, LR scheduler, sampler epoch and RNG, and puts back only the parts it is given; the
engine's counters are that object's; one engine makes one `ShardedState` and reuses it for every
save and load, which installs through `ZeroOptimizer.install_loaded`."""

from __future__ import annotations

import random

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from zeroshard.core.scaler import LossScaler
from zeroshard.train_state import TrainState
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model


class _Optimizer:
    """What TrainState reaches of a ZeroOptimizer: its step count and loss scaler."""

    def __init__(self):
        self.steps = 0
        self.scaler = LossScaler(enabled=True, initial_scale_power=8)


def _train_state() -> TrainState:
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    state = TrainState(_Optimizer(), torch.optim.lr_scheduler.StepLR(sgd, 1, gamma=0.5),
                       accumulation_steps=4)
    data = list(range(8))
    state.dataloader = DataLoader(data, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    return state


def test_train_state_round_trips_every_part():
    saved = _train_state()
    saved.global_steps, saved.global_samples, saved.micro_steps, saved.skipped_steps = 5, 40, 20, 1
    saved.optimizer.steps = 5
    saved.scaler.update(overflow=True, step=5)
    for _ in range(3):
        saved.lr_scheduler.optimizer.step()
        saved.lr_scheduler.step()
    saved.sampler.set_epoch(7)
    torch.manual_seed(11)
    random.seed(12)
    state = saved.state_dict()
    expected = (torch.rand(3), random.random())
    assert state["counters"] == {"global_steps": 5, "global_samples": 40, "micro_steps": 20,
                                 "skipped_steps": 1, "optimizer_steps": 5}
    assert state["sampler_epoch"] == 7 and state["lr_scheduler"]["last_epoch"] == 3

    loaded = _train_state()
    loaded.load_state_dict(state)
    assert loaded.counters() == state["counters"]
    assert loaded.scaler.state_dict() == saved.scaler.state_dict() != _train_state().scaler.state_dict()
    assert loaded.lr_scheduler.state_dict() == saved.lr_scheduler.state_dict()
    assert loaded.sampler.epoch == 7
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_train_state_puts_back_only_what_it_is_given():
    # A DeepSpeed checkpoint: no micro-step or optimizer-step count, no RNG, scheduler not loaded.
    state = _train_state()
    before = state.lr_scheduler.state_dict()
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    state.load_state_dict({"counters": {"global_steps": 6, "global_samples": 48,
                                        "skipped_steps": 2},
                           "lr_scheduler": None, "scaler": None})
    assert state.counters() == {"global_steps": 6, "global_samples": 48, "micro_steps": 24,
                                "skipped_steps": 2, "optimizer_steps": 6}
    assert state.lr_scheduler.state_dict() == before
    assert state.sampler.epoch == 0
    assert torch.equal(torch.get_rng_state(), rng)


def _engine_case(rank, world, root):
    import zeroshard
    from zeroshard.core.optim import ZeroOptimizer
    from zeroshard.core.state import ShardedState

    made, installs = [], []
    make, install = ShardedState.__init__, ZeroOptimizer.install_loaded
    ShardedState.__init__ = lambda self, opt: made.append(1) or make(self, opt)
    ZeroOptimizer.install_loaded = lambda self, *a, **k: installs.append(1) or install(self, *a, **k)
    try:
        model = make_model()
        engine, *_ = zeroshard.initialize(
            model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
            config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}})
        tokens, targets = make_batches(1, 4)[0]
        engine.backward(lm_loss(engine(tokens), targets))
        engine.step()
        counted = (engine.global_steps, engine.train_state.global_steps, engine.micro_steps)
        engine.global_steps = 9  # the engine's counters are its TrainState's
        delegated = engine.train_state.global_steps
        engine.save_checkpoint(root, tag="a")
        engine.save_checkpoint(root, tag="b", exclude_frozen_parameters=True)
        engine.train_state.global_steps = 0
        engine.load_checkpoint(root, tag="a")
        return {"counted": counted, "delegated": delegated, "restored": engine.global_steps,
                "made": len(made), "installs": len(installs)}
    finally:
        ShardedState.__init__, ZeroOptimizer.install_loaded = make, install


def test_engine_owns_its_train_state_and_one_sharded_state(tmp_path):
    (out,) = run_world(1, _engine_case, str(tmp_path))
    assert out["counted"] == (1, 1, 1)
    assert out["delegated"] == 9 and out["restored"] == 9
    # Two saves and a load: one ShardedState, made once; the load installed through the optimizer.
    assert out["made"] == 1 and out["installs"] == 1
