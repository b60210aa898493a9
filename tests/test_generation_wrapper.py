"""core/generation.py's `generate` wrapper in one process, with a stand-in stage-3 policy: the
model is pinned around the call while it fits (synced_gpus off), not pinned over the budget
(synced_gpus on with several ranks), and `uninstall` gives back exactly what was there before,
a class method or another wrapper installed on the instance."""

from __future__ import annotations

import contextlib

from torch import nn

from zeroshard.core import generation


class _Model(nn.Module):
    def generate(self, prompt, synced_gpus=None):
        return ("class", synced_gpus)


class _Unit:
    padded_numel = 6


class _Policy:
    def __init__(self, budget: int, world: int = 2):
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


def test_pinned_for_the_call_while_it_fits():
    model, policy = _Model(), _Policy(budget=12)
    generation.install(model, policy)
    assert model.generate("p") == ("class", False)
    assert policy.calls == [("pin", [0, 1]), ("unpin", [0, 1])]
    assert model.generate("p", synced_gpus=True) == ("class", True)  # the caller decides


def test_over_the_budget_each_step_gathers_with_synced_gpus():
    model, policy = _Model(), _Policy(budget=11)
    generation.install(model, policy)
    assert model.generate("p") == ("class", True) and policy.calls == []
    one_rank = _Model()
    generation.install(one_rank, _Policy(budget=11, world=1))
    assert one_rank.generate("p") == ("class", None)


def test_uninstall_gives_back_what_was_there():
    model = _Model()
    generation.install(model, _Policy(budget=12))
    generation.uninstall(model)
    assert "generate" not in model.__dict__ and model.generate("p") == ("class", None)
    model.generate = lambda prompt, synced_gpus=None: ("instance", synced_gpus)
    generation.install(model, _Policy(budget=12))
    assert model.generate("p") == ("instance", False)
    generation.uninstall(model)
    assert model.generate("p") == ("instance", None)
