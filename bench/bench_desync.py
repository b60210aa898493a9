"""Stage-3 step time with the old per-unit desync check vs the watchdog, paired in one process;
or (`--counts STAGE`) a stage's step with and without the step counts carried in its collectives.

`bench_zero.py --desync per-unit|watchdog` runs the two as separate jobs; on a shared machine the
load drifts between jobs by more than the difference being measured. Here the same 2 ranks train
bench_zero's GPT-2 (same config, AdamW, stage-3 knobs) and alternate the two every step, so
drift hits both alike; the per-step difference (slower rank) is reported. With `--counts S` the
two modes are stage S with the step-count check of `core/step_check.py` (a few extra elements
in one all-reduce, one comparison read with the step's flag) and with it switched off. Launch
with torchrun:

    torchrun --standalone --nproc-per-node 2 bench/bench_desync.py --size small --steps 60
    torchrun --standalone --nproc-per-node 2 bench/bench_desync.py --size large --counts 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_zero  # noqa: E402 - the shared model, config and the per-unit check


def main() -> None:
    """Train, alternating the two checks per step; rank 0 prints medians and the paired gap."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=list(bench_zero.SIZES), default="small")
    parser.add_argument("--steps", type=int, default=60, help="timed steps, half each mode")
    parser.add_argument("--counts", type=int, default=None, metavar="STAGE",
                        help="compare STAGE with and without the step-count check instead")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    import zeroshard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(bench_zero.gpt2_config(args.size))
    model.train()
    stage = 3 if args.counts is None else args.counts
    options = argparse.Namespace(bucket=1e7, size=args.size, impl=f"zeroshard-s{stage}",
                                 micro_batch=args.micro_batch, desync="watchdog")
    engine, _, _, _ = zeroshard.initialize(
        model=model, config=bench_zero.zero_config(options, stage, for_deepspeed=False),
        optimizer=torch.optim.AdamW(model.parameters(), lr=bench_zero.LR, weight_decay=0.0))
    comm = engine.comm
    if args.counts is None:
        modes = ("per-unit", "watchdog")
        names = ("all_gather", "reduce_scatter")
        plain = {n: getattr(comm, n) for n in names}
        bench_zero.per_unit_guard(comm)
        guarded = {n: getattr(comm, n) for n in names}

        def switch(mode):
            for name in names:
                setattr(comm, name, (guarded if mode == "per-unit" else plain)[name])
    else:
        from zeroshard.core import stage0, step_check

        modes = ("counts", "no-counts")
        with_counts = step_check.tail_numel

        def switch(mode):
            # No extra elements: nothing is written, carried, compared or read.
            tail = with_counts if mode == "counts" else (lambda world_size: 0)
            stage0.tail_numel = step_check.tail_numel = tail
    rank = dist.get_rank()
    tokens = torch.randint(0, bench_zero.VOCAB, (args.micro_batch, args.seq_len),
                           generator=torch.Generator().manual_seed(rank))
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(args.steps + 2):  # two warm-up steps, one per mode
        # A B B A A B ...: each mode runs as often first as second in its pair of steps, so a
        # step that is slower for coming after the other (caches, the peer's timing) is shared.
        mode = modes[(i + i // 2) % 2]
        switch(mode)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        if i >= 2:
            wall[mode].append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (wall, cpu))
    if rank == 0:
        slowest = {m: [max(r[0][m][i] for r in every) for i in range(len(wall[m]))] for m in wall}
        for mode in wall:
            cpus = [max(r[1][mode][i] for r in every) for i in range(len(wall[mode]))]
            print(f"{args.size} {mode}: median step {1e3 * statistics.median(slowest[mode]):.1f} ms,"
                  f" CPU {1e3 * statistics.median(cpus):.1f} ms, {len(cpus)} steps")
        first, second = modes
        gaps = [p - w for p, w in zip(slowest[first], slowest[second])]
        ratios = [p / w for p, w in zip(slowest[first], slowest[second])]
        print(f"{args.size} {first} minus {second}, paired: median "
              f"{1e3 * statistics.median(gaps):.1f} ms, mean {1e3 * statistics.mean(gaps):.1f} ms,"
              f" median ratio {statistics.median(ratios):.4f}")
    dist.barrier()


if __name__ == "__main__":
    main()
