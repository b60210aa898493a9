"""Repeated two-rank launches of a short stage-3 training script: does every rank exit cleanly?

A rank that aborts after finishing its work ("terminate called without an active exception",
SIGABRT) makes `zeroshard run` report a failed run for a completed one. This launches the same
script `--runs` times under `zeroshard run --nproc-per-node 2` and counts exit codes, aborts and
the tell-tale message. The script ends the way users' scripts end: it just returns, with no
`destroy_process_group()` and no `os._exit`.

    python bench/exit_loop.py --runs 30
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time

SCRIPT = textwrap.dedent("""
    import torch
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
                                  for _ in range(4)], torch.nn.Linear(64, 8))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    for step in range(4):
        x = torch.randn(4, 64)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    print(f"rank {engine.rank} done", flush=True)
""")


def main() -> int:
    """Launch the script `--runs` times; print one line per failed run and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", ZEROSHARD_QUIET="1")
    failures, aborts, seconds = 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "short_stage3.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        for run in range(args.runs):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "zeroshard.cli", "run",
                                   "--nproc-per-node", "2", script], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=300)
            seconds.append(time.perf_counter() - start)
            out = proc.stdout + proc.stderr
            aborted = "terminate called" in out or "SIGABRT" in out or "Signals.SIGABRT" in out
            done = out.count(" done")
            aborts += aborted
            if proc.returncode != 0 or aborted or done != 2:
                failures += 1
                tail = " | ".join(out.strip().splitlines()[-3:])
                print(f"run {run + 1}: exit {proc.returncode}, {done}/2 ranks done, "
                      f"abort={aborted}: {tail[:300]}", flush=True)
    print(f"{args.runs} launches, {failures} failed, {aborts} aborted at exit; "
          f"median {sorted(seconds)[len(seconds) // 2]:.1f} s per launch")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
