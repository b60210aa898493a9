"""How far bf16 training drifts from fp32 training: the demo model (`zeroshard demo`'s TinyGPT),
2 gloo ranks on CPU (`--world`), the same data and initial weights, 100 steps of AdamW per stage.

    PYTHONPATH=src python bench/bench_precision.py [--steps 100] [--stages 0,1,2,3]
        [--comm fp32,bf16]       # communication_data_type values to run besides fp32 training
        [--world 4] [--accum 4]  # ranks; micro-steps per optimizer step

Drift is measured three ways: on all parameters together after the last step,
||P_bf16 - P_fp32|| / ||P_fp32 - P_init|| (the error relative to how far training moved them);
the worst single parameter tensor by the same ratio; and the mean |loss_bf16 - loss_fp32| over
the steps. "default" is bf16 with no `communication_data_type` key (what the library does by
default); "bf16" sums bf16 gradients in bf16, which is what zeroshard did before it reduced in
fp32 (the same values at one micro-step per step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(stage: int, precision: str, comm: str | None, steps: int, data, rank: int, world: int,
           accum: int = 1):
    import zeroshard
    from zeroshard.cli.demo import GPTConfig, TinyGPT, batch_for_step

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig())
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
              "gradient_accumulation_steps": accum,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e5},
              "bf16": {"enabled": precision == "bf16"}}
    if comm not in (None, "default"):
        config["communication_data_type"] = comm
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    loss, losses = None, []
    for step in range(steps * accum):  # engine.step() steps the optimizer every `accum` calls
        x, y = batch_for_step(data, step, rank, world, 4, model.cfg.block_size, 0)
        logits = engine(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        if (step + 1) % accum == 0:
            losses.append(loss.detach().float().clone())
    comm_bytes = engine.comm_report()["reduce_scatter"] + engine.comm_report()["all_reduce"]
    engine.destroy()  # whole again at stage 3
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    curve = torch.stack(losses)
    dist.all_reduce(curve)
    return init, params, (curve / world).tolist(), comm_bytes


def _worker(rank, world, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), ZEROSHARD_QUIET="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from zeroshard.cli.demo import encode, load_corpus

    data = encode(load_corpus(200_000))
    rows = []
    for stage in args.stages:
        init, ref, ref_loss, ref_bytes = _train(stage, "fp32", None, args.steps, data, rank, world,
                                                args.accum)
        for comm in args.comm:
            _, got, loss, nbytes = _train(stage, "bf16", comm, args.steps, data, rank, world,
                                          args.accum)
            worst = max(((got[n] - ref[n]).norm() / (ref[n] - init[n]).norm()).item() for n in ref)
            diff = torch.cat([(got[n] - ref[n]).reshape(-1) for n in ref]).norm()
            moved = torch.cat([(ref[n] - init[n]).reshape(-1) for n in ref]).norm()
            loss_gap = sum(abs(a - b) for a, b in zip(loss, ref_loss)) / len(loss)
            rows.append({"stage": stage, "comm": comm, "drift": (diff / moved).item(),
                         "worst": worst, "loss_gap": loss_gap,
                         "loss_fp32": ref_loss[-1], "loss_bf16": loss[-1],
                         "reduce_bytes_fp32_run": ref_bytes, "reduce_bytes": nbytes})
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(rows, fh)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    """Run the comparison and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--comm", default="default,bf16")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    parser.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--out", default="/tmp/bench_precision.json")
    args = parser.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    args.comm = args.comm.split(",")
    mp.start_processes(_worker, args=(args.world, _port(), args, args.out), nprocs=args.world,
                       start_method="spawn")
    with open(args.out) as fh:
        rows = json.load(fh)
    print(f"{args.world} ranks, gradient_accumulation_steps {args.accum}\n")
    print(f"| stage | bf16 run's communication_data_type | parameter drift vs fp32 after "
          f"{args.steps} steps | worst tensor | mean loss gap | final loss fp32 / bf16 "
          "| gradient bytes reduced per rank (bf16 run) |")
    print("|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['stage']} | {r['comm']} | {r['drift']:.4f} | {r.get('worst', 0):.4f} | "
              f"{r.get('loss_gap', 0):.5f} | {r['loss_fp32']:.4f} / {r['loss_bf16']:.4f} | "
              f"{r['reduce_bytes']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
