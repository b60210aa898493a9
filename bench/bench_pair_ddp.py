"""zeroshard stage S vs DDP, step time paired in the same two processes (robust to machine load).

`bench_zero.py` runs each implementation as its own job; on a shared 2-core machine the load
drifts between jobs by more than a few percent, which is the size of the differences the stage
targets are about ("stage 3 within 1.05x of DDP"). Here the same 2 ranks hold bench_zero's GPT-2
twice, once under torch DDP and once under a zeroshard engine (same config and stage-3 knobs as
bench_zero, torch AdamW on both), and alternate the two every step, so load drift hits both alike.
Reported (slower rank per step): median step time of each, the median of the per-step ratios,
the CPU time both ranks used per step (all threads, so gloo's too: under load the CPU work is the
steadier figure), and an optional cProfile of zeroshard's steps on rank 0 (`--profile`).

DDP steps torch's fused AdamW, the kernel zeroshard picks by itself for a torch AdamW
(`--ddp-optimizer default` gives DDP torch's CPU default, the slower per-tensor loop, as earlier
runs of this bench did). Both sides clip gradients as a new user's config does (`--clip`, default
1.0: zeroshard's `gradient_clipping` default, DeepSpeed's since 0.19.3, and HF Trainer's
`max_grad_norm`, whose DDP loop calls `clip_grad_norm_`); `--clip 0` compares neither clipping.
Runs before 2026-12-03 had zeroshard clip at 1.0 and DDP not clip at all. Peak RSS cannot be
told apart when both live in one process: `--only NAME` trains that one implementation alone
(fresh processes, so run it once per implementation, interleaved) and prints its peak RSS, max
over ranks.

    torchrun --standalone --nproc-per-node 2 bench/bench_pair_ddp.py --size small --stages 3
    torchrun --standalone --nproc-per-node 2 bench/bench_pair_ddp.py --size large --stages 0,3
    torchrun --standalone --nproc-per-node 2 bench/bench_pair_ddp.py --size large --stages 0 \
        --only zeroshard-s0 --steps 5
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_zero  # noqa: E402 - the shared model and config


def _step(model, opt, tokens, clip: float) -> None:
    loss = model(input_ids=tokens, labels=tokens).loss
    if hasattr(model, "step") and hasattr(model, "backward"):  # a zeroshard engine
        model.backward(loss)
        model.step()
    else:
        loss.backward()
        if clip > 0:  # what the engine's gradient_clipping does, in a DDP loop (HF Trainer's)
            import torch

            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)


def main() -> None:
    """Train DDP and zeroshard alternately; rank 0 prints medians and paired ratios."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=list(bench_zero.SIZES), default="small")
    parser.add_argument("--stages", default="3", help="comma-separated zeroshard stages")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per implementation")
    parser.add_argument("--profile", action="store_true", help="cProfile zeroshard on rank 0")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="gradient clipping on both sides: zeroshard's gradient_clipping "
                             "(1.0 is its default, and DeepSpeed's since 0.19.3) and "
                             "clip_grad_norm_ in DDP's loop; 0: neither clips")
    parser.add_argument("--ddp-optimizer", choices=("fused", "default"), default="fused",
                        help="DDP's AdamW kernel: fused (as zeroshard's) or torch's CPU default")
    parser.add_argument("--only", default=None,
                        help="train only this implementation (ddp or zeroshard-sK; peak RSS)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import GPT2LMHeadModel

    import zeroshard

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    rank = dist.get_rank()
    impls = {}
    wanted = (lambda name: args.only in (None, name))
    psi = bench_zero.count_params(args.size)
    if wanted("ddp"):  # not even built otherwise: its memory would count in the other's peak
        torch.manual_seed(0)
        ddp = DistributedDataParallel(GPT2LMHeadModel(bench_zero.gpt2_config(args.size)))
        fused = {"fused": True} if args.ddp_optimizer == "fused" else {}
        impls["ddp"] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=bench_zero.LR,
                                               weight_decay=0.0, **fused))
    for stage in (int(s) for s in args.stages.split(",")):
        if not wanted(f"zeroshard-s{stage}"):
            continue
        torch.manual_seed(0)
        model = GPT2LMHeadModel(bench_zero.gpt2_config(args.size))
        options = argparse.Namespace(bucket=1e7, size=args.size, impl=f"zeroshard-s{stage}",
                                     micro_batch=args.micro_batch, desync="watchdog")
        config = bench_zero.zero_config(options, stage, for_deepspeed=False)
        config["gradient_clipping"] = args.clip
        engine, _, _, _ = zeroshard.initialize(
            model=model, config=config,
            optimizer=torch.optim.AdamW(model.parameters(), lr=bench_zero.LR, weight_decay=0.0))
        impls[f"zeroshard-s{stage}"] = (engine, None)
    if not impls:
        sys.exit(f"--only {args.only}: not among ddp and the --stages {args.stages}")
    tokens = torch.randint(0, bench_zero.VOCAB, (args.micro_batch, args.seq_len),
                           generator=torch.Generator().manual_seed(rank))
    wall: dict[str, list[float]] = {name: [] for name in impls}
    cpu: dict[str, list[float]] = {name: [] for name in impls}  # all threads of the process
    profiler = cProfile.Profile() if args.profile and rank == 0 else None
    for i in range(args.steps + 2):  # two warm-up rounds
        # Every other round in reverse order, so that no implementation always runs first.
        order = list(impls.items()) if i % 2 == 0 else list(impls.items())[::-1]
        for name, (model, opt) in order:
            dist.barrier()
            profiling = profiler is not None and name != "ddp" and i >= 2
            if profiling:
                profiler.enable()
            c0, t0 = time.process_time(), time.perf_counter()
            _step(model, opt, tokens, args.clip)
            elapsed, used = time.perf_counter() - t0, time.process_time() - c0
            if profiling:
                profiler.disable()
            if i >= 2:
                wall[name].append(elapsed)
                cpu[name].append(used)
    every = [None] * dist.get_world_size()
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    dist.all_gather_object(every, (wall, cpu, rss_mib))
    if rank == 0 and args.only is not None:
        name = next(iter(impls))
        times = [max(r[0][name][i] for r in every) for i in range(args.steps)]
        print(f"{args.size} {name} alone: median step {1e3 * statistics.median(times):.1f} ms, "
              f"peak RSS {max(r[2] for r in every):.0f} MiB (max over ranks)")
    elif rank == 0:
        slowest = {n: [max(r[0][n][i] for r in every) for i in range(args.steps)] for n in wall}
        cpus = {n: [sum(r[1][n][i] for r in every) for i in range(args.steps)] for n in cpu}
        base = slowest["ddp"]
        print(f"{args.size}: Psi = {psi:,}, {args.steps} paired steps, 2 ranks, micro batch "
              f"{args.micro_batch} x {args.seq_len} tokens, DDP AdamW {args.ddp_optimizer}, "
              f"gradient clipping {args.clip:g} on both sides")
        for name, times in slowest.items():
            ratio = statistics.median(t / b for t, b in zip(times, base))
            cpu_ratio = statistics.median(c / b for c, b in zip(cpus[name], cpus["ddp"]))
            print(f"  {name:14s} median step {1e3 * statistics.median(times):7.1f} ms   "
                  f"paired ratio to DDP {ratio:.3f}   CPU (both ranks) "
                  f"{1e3 * statistics.median(cpus[name]):7.1f} ms, ratio {cpu_ratio:.3f}")
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    dist.barrier()
    for name, (model, _) in impls.items():
        if name != "ddp":
            model.destroy()


if __name__ == "__main__":
    main()
