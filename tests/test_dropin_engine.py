"""What DeepSpeed scripts do to the engine that DeepSpeed tolerates: ranks passing different
checkpoint tags or directories (the tutorial's `ckpt_id = loss.item()`, a timestamped directory)
are refused on every rank before anything is written; `"zero_optimization": true` is stage 1;
`torch_autocast` runs the forward under torch.autocast."""

from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice
from zeroshard.checkpoint import CheckpointError

MICRO = 2


def _engine(config_extra=None, stage=2):
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": stage},
              **(config_extra or {})}
    return zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                config=config)[0]


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, dirs, files in os.walk(root) for f in files + dirs)


def _error(fn):
    try:
        fn()
    except (CheckpointError, ValueError) as err:
        # DeepSpeed's tag_validation "fail" raises AssertionError: scripts may catch that.
        kind = " (AssertionError)" if isinstance(err, AssertionError) else ""
        return f"{type(err).__name__}{kind}: {err}"
    return "no error"


def _checks(rank, world, root):
    out = {}
    engine = _engine()
    tokens, targets = micro_slice(make_batches(1, MICRO * world)[0], 0, rank, world, MICRO)
    loss = lm_loss(engine(tokens), targets)
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(root)  # a good one: global_step1, named by 'latest'
    # Every rank lists the directory before any rank starts the next save (whose partial
    # directory rank 0 makes before the ranks compare notes).
    engine.comm.barrier()
    before = _listing(root)
    engine.comm.barrier()
    out["loss_tag"] = _error(lambda: engine.save_checkpoint(root, tag=f"{loss.item() + rank:.4f}"))
    out["dir"] = _error(lambda: engine.save_checkpoint(os.path.join(root, f"run-{rank}"), tag="a"))
    out["client"] = _error(lambda: engine.save_checkpoint(
        root, tag="b", client_state={"bad": object()} if rank == 1 else {}))
    after = _listing(root)
    out["unchanged"] = after == before
    out["changed"] = sorted(set(after) ^ set(before))
    with open(os.path.join(root, "latest")) as fh:
        out["latest"] = fh.read()
    engine.destroy()
    # DeepSpeed's getting-started config: "zero_optimization": true is stage 1.
    engine = zeroshard.initialize(model=make_model(), config={
        "train_batch_size": 8, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "zero_optimization": True})[0]
    out["switch_stage"] = engine.zero_optimization_stage()
    engine.destroy()
    # torch_autocast: the forward runs under torch.autocast(bf16) on fp32 parameters.
    for enabled in (True, False):
        engine = _engine({"torch_autocast": {"enabled": enabled, "dtype": "bfloat16"}}, stage=1)
        got = engine(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            want = engine.module(tokens)
        out[f"autocast_{enabled}"] = (got.dtype, torch.equal(got, want),
                                      {p.dtype for p in engine.module.parameters()})
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(2, _checks, str(tmp_path_factory.mktemp("agree")))


def test_differing_tags_are_refused_on_every_rank_naming_both(results):
    for got in results:
        assert got["loss_tag"].startswith(
            "CheckpointTagError (AssertionError): save_checkpoint: the ranks disagree on the "
            "checkpoint tag"), got["loss_tag"]
        assert "rank 0: '" in got["loss_tag"] and "rank 1: '" in got["loss_tag"]
        assert "nothing was written" in got["loss_tag"]


def test_differing_directories_are_refused_on_every_rank(results):
    for got in results:
        assert got["dir"].startswith("CheckpointError: "), got["dir"]  # not a tag problem
        assert "disagree on the checkpoint save_dir" in got["dir"], got["dir"]
        assert "run-0" in got["dir"] and "run-1" in got["dir"]


def test_one_rank_bad_client_state_fails_every_rank(results):
    for got in results:
        assert got["client"].startswith("ValueError: rank 1: client_state can only hold"), got["client"]


def test_nothing_written_and_latest_untouched(results):
    for got in results:
        assert got["unchanged"] and got["latest"] == "global_step1", got["changed"]


def test_zero_optimization_true_is_stage_1(results):
    assert [got["switch_stage"] for got in results] == [1, 1]


def test_torch_autocast_runs_the_forward_under_autocast(results):
    for got in results:
        assert got["autocast_True"] == (torch.bfloat16, True, {torch.float32})
        assert got["autocast_False"] == (torch.float32, True, {torch.float32})
