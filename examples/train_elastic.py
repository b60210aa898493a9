"""The recommended zeroshard training loop: resume from `latest`, save every few steps.

    zeroshard run --nproc-per-node 2 --max-restarts 3 examples/train_elastic.py --ckpt runs/ckpt

Run under torchrun's elastic agent (`--max-restarts`), a job whose rank dies is restarted from
scratch and every rank resumes from the newest complete checkpoint. Because the data of step n
is chosen by n (not by how many steps this process ran), and the checkpoint restores parameters,
optimizer state, LR schedule, loss scaler, step counters and RNG states, the restarted job ends
with exactly the parameters of an uninterrupted one.

Across machines, start the same command on every node with a c10d rendezvous (see the README):

    zeroshard run --nnodes 2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint node0:29400 --rdzv-id job1 examples/train_elastic.py --ckpt /shared/ckpt

For the tests, on a run that started from scratch: `--kill-rank R --kill-at N` makes rank R
SIGKILL itself after step N; `--kill-node G --kill-at N` makes the ranks of node G (torchrun's
GROUP_RANK) SIGKILL their torchrun agent and themselves, as when that machine fails.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import zeroshard


def make_model() -> nn.Module:
    """A small language model (same weights on every rank: seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32),
                         nn.Linear(32, 64))


def batch_for_step(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of step `step` for `rank`: chosen by the step number, so a resumed job sees the
    same batches as an uninterrupted one."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 64, (micro, 9), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line above."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint directory (save_dir)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-node", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> None:
    """Train `--steps` optimizer steps, checkpointing every `--save-every`; rank 0 saves the final
    parameters to `--out`."""
    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
              "zero_optimization": {"stage": args.stage}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    path, _ = engine.load_checkpoint(args.ckpt)  # (None, None) on a fresh start
    if path is not None and engine.rank == 0:
        print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    # Not the restart count: a replacement node's agent starts counting at 0 again.
    from_scratch = path is None
    node = int(os.environ.get("GROUP_RANK", "0"))
    while engine.global_steps < args.steps:
        inputs, targets = batch_for_step(engine.global_steps, engine.rank, 4)
        logits = engine(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
        engine.backward(loss)
        engine.step()
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt)
        if from_scratch and engine.global_steps == args.kill_at:
            if node == args.kill_node and "TORCHELASTIC_RUN_ID" in os.environ:
                os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent that started this rank
            if node == args.kill_node or engine.rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
    state = engine.consolidated_state_dict()
    if engine.rank == 0 and args.out:
        torch.save(state, args.out)
    engine.destroy()


def main() -> None:
    """Train, then leave together."""
    train(parse_args())
    # Leave together: a rank tearing gloo down while a peer still talks to it can abort at exit,
    # which the elastic agent would count as a failure.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
