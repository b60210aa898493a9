"""Peak memory while *building* a model: normally vs under `zeroshard.Init` (stage 3), 2 CPU ranks.

The model is 8 x nn.TransformerEncoderLayer(768, 12 heads, 3072) plus a 768 x 256 embedding and
head, ~57 M parameters (as bench_zero.py). Each variant runs in fresh processes; the figure is the
rise of ru_maxrss over the process's RSS just before construction, max over ranks.

    python bench/bench_init.py            # both variants, 3 rounds, median
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

LAYERS, WIDTH = 8, 768


def build():
    """The model: plain PyTorch modules that initialise themselves in their constructors."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, WIDTH)
            self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(WIDTH, 12, 4 * WIDTH,
                                                                   batch_first=True)
                                        for _ in range(LAYERS))
            self.head = nn.Linear(WIDTH, 256)

    torch.manual_seed(0)
    return Net()


def worker(variant: str, out: str) -> None:
    import resource

    import psutil
    import torch

    import zeroshard

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    before = psutil.Process().memory_info().rss
    if variant == "init":
        with zeroshard.Init(config={"train_batch_size": 2, "zero_optimization": {"stage": 3}}):
            model = build()
    else:
        model = build()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False))
                  for m in build().modules()) if variant == "normal" else None
    with open(f"{out}/rank{os.environ['RANK']}.json", "w") as fh:
        json.dump({"rise": peak - before, "psi": psi, "largest_module": largest}, fh)
    torch.distributed.destroy_process_group()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results = {}
    for variant in ("normal", "init"):
        rises = []
        for _ in range(rounds):
            with tempfile.TemporaryDirectory() as out:
                done = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                                       "--standalone", "--nproc-per-node", "2", __file__,
                                       "--worker", variant, out], capture_output=True, text=True)
                try:  # a result written before an abort at exit (gloo teardown) still counts
                    ranks = [json.load(open(f"{out}/rank{r}.json")) for r in range(2)]
                except FileNotFoundError:
                    sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
            rises.append(max(r["rise"] for r in ranks))
            results[variant] = ranks[0]
        results[variant]["median_rise"] = statistics.median(rises)
    psi = results["normal"]["psi"]
    mib = 2**20
    print(f"model: {psi:,} parameters = {4 * psi / mib:.0f} MiB fp32; largest module's own "
          f"parameters: {4 * results['normal']['largest_module'] / mib:.0f} MiB; world size 2, "
          f"{rounds} rounds (median)")
    for variant in ("normal", "init"):
        print(f"  {variant:7s} peak RSS rise during construction: "
              f"{results[variant]['median_rise'] / mib:6.0f} MiB")
    print(f"  Init's target, one module + Psi/N: "
          f"{(4 * results['normal']['largest_module'] + 4 * psi / 2) / mib:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
