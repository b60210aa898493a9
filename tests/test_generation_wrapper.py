"""compat/hf/generation.py's `generate` wrapper in one process, with a stand-in stage-3 policy
seen through core/policy_view.py's view: the model is pinned around the call while it fits
(synced_gpus off), not pinned over the budget (synced_gpus on with several ranks), and what
`install` returns gives back exactly what was there before, a class method or another wrapper
installed on the instance."""

from __future__ import annotations

import contextlib

from torch import nn

from zeroshard.compat.hf import generation
from zeroshard.core.policy_view import Stage3View


class _Model(nn.Module):
    def generate(self, prompt, synced_gpus=None):
        return ("class", synced_gpus)


class _Unit:
    padded_numel = 6


class _Policy:
    def __init__(self, model: nn.Module | None, budget: int, world: int = 2):
        self.module = model
        self.comm = type("Comm", (), {"world_size": world})()
        self.sharded = {0, 1}
        self.by_index = {0: _Unit(), 1: _Unit()}
        self.options = type("Options", (), {"max_live_parameters": budget})()
        self.calls = []

    @contextlib.contextmanager
    def hold_all(self):
        self.calls.append(("pin", sorted(self.sharded)))
        try:
            yield
        finally:
            self.calls.append(("unpin", sorted(self.sharded)))


def _install(model, policy):
    return generation.install(Stage3View(policy))


def test_pinned_for_the_call_while_it_fits():
    model = _Model()
    policy = _Policy(model, budget=12)
    _install(model, policy)
    assert model.generate("p") == ("class", False)
    assert policy.calls == [("pin", [0, 1]), ("unpin", [0, 1])]
    assert model.generate("p", synced_gpus=True) == ("class", True)  # the caller decides


def test_over_the_budget_each_step_gathers_with_synced_gpus():
    model = _Model()
    policy = _Policy(model, budget=11)
    _install(model, policy)
    assert model.generate("p") == ("class", True) and policy.calls == []
    one_rank = _Model()
    _install(one_rank, _Policy(one_rank, budget=11, world=1))
    assert one_rank.generate("p") == ("class", None)


def test_uninstall_gives_back_what_was_there():
    model = _Model()
    undo = _install(model, _Policy(model, budget=12))
    assert _install(model, _Policy(model, budget=12)) is None  # installed once
    undo()
    assert "generate" not in model.__dict__ and model.generate("p") == ("class", None)
    model.generate = lambda prompt, synced_gpus=None: ("instance", synced_gpus)
    undo = _install(model, _Policy(model, budget=12))
    assert model.generate("p") == ("instance", False)
    undo()
    assert model.generate("p") == ("instance", None)


def test_nothing_to_wrap():
    """A model without `generate` (or a policy without a model) is left alone."""
    plain = nn.Linear(2, 2)
    assert _install(plain, _Policy(plain, budget=12)) is None and "generate" not in plain.__dict__
    assert generation.install(Stage3View(_Policy(None, budget=12))) is None
