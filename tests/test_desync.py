"""Ranks that take different paths at stage 3 get a readable DesyncError, quickly, on every rank.

Three ways to desynchronise, in one world of 2 ranks: rank 1 skips a block in one forward (the
gathers differ), rank 1 steps without running the micro-step (a step meets a gather), and rank 1
leaves the stage-3 path altogether (rank 0 times out after `zeroshard_desync_timeout` seconds).
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import TinyLM, lm_loss, make_batches, micro_slice

TIMEOUT = 5


class SkippingLM(TinyLM):
    """TinyLM whose block2 is skipped when `skip` is set (data-dependent control flow)."""

    skip = False

    def forward(self, tokens=None, *, batch=None):
        h = self.embed(tokens)
        h = h + self.block1(h)
        if not self.skip:
            h = h + self.block2(h)
        return self.head(h)


def _engine():
    torch.manual_seed(0)
    model = SkippingLM()
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "zeroshard_desync_timeout": TIMEOUT}}
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return engine, model


def _scenario(rank, world, kind):
    engine, model = _engine()
    batches = make_batches(3, 2 * world)
    start = time.monotonic()
    try:
        for step, batch in enumerate(batches):
            tokens, targets = micro_slice(batch, 0, rank, world, 2)
            diverge = step == 1 and rank == 1
            if kind == "skip_block":
                model.skip = diverge
            elif kind == "step_only" and diverge:
                engine.step()
                continue
            elif kind == "leave" and diverge:
                time.sleep(TIMEOUT + 3)  # does nothing collective; rank 0 must time out
                return {"error": None, "seconds": time.monotonic() - start}
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()
    except zeroshard.DesyncError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _all(rank, world):
    return {kind: _scenario(rank, world, kind) for kind in ("skip_block", "step_only", "leave")}


@pytest.fixture(scope="module")
def results():
    """Per-rank outcome of each scenario."""
    start = time.monotonic()
    out = run_world(2, _all)
    return out, time.monotonic() - start


def test_whole_run_finishes_well_within_a_minute(results):
    assert results[1] < 60


@pytest.mark.parametrize("kind", ["skip_block", "step_only"])
def test_every_rank_names_both_ranks_and_what_they_did(results, kind):
    for rank, got in enumerate(results[0]):
        message = got[kind]["error"]
        assert message is not None, f"rank {rank} did not detect the desync"
        assert "desynchronised" in message and "rank 0:" in message and "rank 1:" in message
        assert got[kind]["seconds"] < TIMEOUT  # detected by comparison, not by waiting
    if kind == "skip_block":
        # With prefetch both ranks gather block2; the paths part at its reduce-scatter.
        # (The unit's number depends on how the parameters outside the blocks are split.)
        assert re.search(r"reduce-scatter of unit \d+ \(block2", results[0][0][kind]["error"])
    else:
        assert "optimizer step" in results[0][0][kind]["error"]


def test_a_rank_that_never_arrives_times_out_with_a_message(results):
    message = results[0][0]["leave"]["error"]
    assert message is not None and f"waited {TIMEOUT}s" in message
    assert "never reached a stage-3 collective" in message
