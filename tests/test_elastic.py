"""Elastic restart: `zeroshard run --max-restarts 1` of the recommended loop (examples/
train_elastic.py), with rank 1 SIGKILLed after step 5, resumes from the step-4 checkpoint and ends
with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "train_elastic.py")


def _run(tmp_path, name, *extra):
    out = tmp_path / f"{name}.pt"
    done = subprocess.run(
        [sys.executable, "-m", "zeroshard.cli", "run", "--nproc-per-node", "2", "--max-restarts",
         "1", EXAMPLE, "--ckpt", str(tmp_path / name), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ZEROSHARD_QUIET": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True), done.stdout + done.stderr


def test_killed_rank_restarts_and_finishes_like_an_uninterrupted_run(tmp_path):
    killed, log = _run(tmp_path, "killed", "--kill-rank", "1", "--kill-at", "5")
    assert "resumed from" in log and "global_step4 at step 4" in log
    whole, _ = _run(tmp_path, "whole")
    assert sorted(killed) == sorted(whole)
    assert all(torch.equal(killed[k], whole[k]) for k in whole)
