"""Every seed config our users started from trains (offload ones included)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.config import load_config, require_supported
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model

CONFIGS = sorted((Path(__file__).parent.parent / "examples" / "configs").glob("*.json"))


def _train_each(rank, world):
    out = {}
    for path in CONFIGS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_config(str(path), world_size=world)
            require_supported(cfg)
            model = make_model()
            optimizer = None if cfg.optimizer else torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=str(path))
        micro = engine.train_micro_batch_size_per_gpu()
        losses = []
        for tokens, targets in make_batches(2 * engine.gradient_accumulation_steps(), micro):
            loss = lm_loss(engine(tokens), targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[path.name] = ("trained", engine.global_steps, all(map(math.isfinite, losses)))
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def outcomes():
    """Rank 0's outcome per seed config at world size 2."""
    return run_world(2, _train_each)[0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_seed_config_trains(outcomes, path):
    # Every seed config, offload included, trains two steps with finite losses.
    assert outcomes[path.name] == ("trained", 2, True), outcomes[path.name]
