"""Preemption: a scheduler's SIGTERM makes every rank save at the same step and exit 0.

    zeroshard run --nproc-per-node 2 examples/train_preemptible.py --ckpt runs/ckpt

`zeroshard run` forwards SIGTERM (and SIGINT) to every worker. Each rank's handler only sets a
flag; the loop reads it once per step through one small all-reduce (MAX), so every rank sees it at
the same step even when the signals arrive a step apart, saves one checkpoint and returns. Every
worker exits 0, so the launcher exits 0 too (143 would mean a worker was stopped by the signal
without saving). Started again, the job resumes from that checkpoint (`latest`).
"""

from __future__ import annotations

import argparse
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

import zeroshard

STOP = {"asked": False}


def _ask_to_stop(signum, frame) -> None:
    """The handler: remember, and let the loop decide at the next step boundary."""
    STOP["asked"] = True


def stop_agreed(device: torch.device) -> bool:
    """Whether any rank was asked to stop (one all-reduce; every rank gets the same answer)."""
    flag = torch.tensor([1.0 if STOP["asked"] else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main(argv: list[str] | None = None) -> int:
    """Train until the step budget or a SIGTERM; save on the way out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint directory (save_dir)")
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--ready", default=None, help="rank 0 touches this file after a step")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _ask_to_stop)
    signal.signal(signal.SIGINT, _ask_to_stop)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    path, _ = engine.load_checkpoint(args.ckpt)  # (None, None) on a first start
    if engine.rank == 0:
        print(f"resumed at step {engine.global_steps}" if path else "started", flush=True)
    while engine.global_steps < args.steps:
        gen = torch.Generator().manual_seed(engine.global_steps * 100 + engine.rank)
        x = torch.randn(4, 16, generator=gen, device=engine.device)
        engine.backward(engine(x).sub(x).pow(2).mean())
        engine.step()
        if args.ready and engine.rank == 0:
            open(args.ready, "a").close()
        if stop_agreed(engine.device):
            engine.save_checkpoint(args.ckpt)
            if engine.rank == 0:
                print(f"preempted: saved step {engine.global_steps}", flush=True)
            break
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
