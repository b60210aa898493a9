"""The CPU optimizer step per unit during backward (offload/early.py) against the step after
backward: step time of stage 2/3 + `offload_optimizer: cpu`, fp32, AdamW, no clipping.

Model: `--layers` x nn.Linear(`--width`, `--width`) with ReLU (default 12 x 1024: 12.6 M
parameters), `reduce_bucket_size` 2 M elements (about one layer per unit), batch 32 rows per
rank, the step in backward forced on (it is off by default on a CPU-only machine). Each
setting runs in its own torchrun job (`--ranks` ranks, one torch thread each); the two settings
alternate `--rounds` times. Reported per setting: median of the timed steps of every round, for
the whole step (forward + backward + engine.step()) and for engine.step() alone.

On a CPU-only machine the "device" is the CPU too, so backward and the CPU step share the cores:
expect no gain here; on a GPU the step of unit i runs while the GPU computes the backward of the
units before it.

Reproduce (about 2 minutes on 2 cores):  python bench/bench_offload_overlap.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(args) -> None:
    import torch

    import zeroshard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    offload = {"device": "cpu", "zeroshard_step_in_backward": args.early}
    config = {"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 2_000_000,
                                    "offload_optimizer": offload}}
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config)
    x = torch.randn(32, args.width)
    whole, step = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = engine(x).square().mean()
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            whole.append(t2 - t0)
            step.append(t2 - t1)
    early = engine.optimizer.placement.early
    counts = dict(early.counts) if early is not None else {}
    if engine.rank == 0:
        print("RESULT " + json.dumps({"whole": whole, "step": step, "counts": counts}), flush=True)
    engine.destroy()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--early", type=lambda s: s == "true", default=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = {True: {"whole": [], "step": []}, False: {"whole": [], "step": []}}
    for _ in range(args.rounds):
        for early in (True, False):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.ranks}",
                   __file__, "--worker", f"--early={str(early).lower()}", f"--stage={args.stage}",
                   f"--layers={args.layers}", f"--width={args.width}",
                   f"--warmup={args.warmup}", f"--steps={args.steps}"]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            got = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
            results[early]["whole"] += got["whole"]
            results[early]["step"] += got["step"]
            results[early]["counts"] = got["counts"]
    params = args.layers * (args.width * args.width + args.width)
    print(f"stage {args.stage}, {args.ranks} ranks, {params / 1e6:.1f} M parameters, "
          f"offload_optimizer cpu, fp32 AdamW, {args.rounds} rounds x {args.steps} steps")
    for early in (False, True):
        r = results[early]
        name = "per unit in backward" if early else "after backward      "
        print(f"  {name}: step {statistics.median(r['whole']) * 1e3:7.1f} ms   "
              f"engine.step() {statistics.median(r['step']) * 1e3:7.1f} ms   units {r['counts']}")


if __name__ == "__main__":
    main()
