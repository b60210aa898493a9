"""Peak memory while *loading* a pretrained Hugging Face GPT-2 (355 M parameters, gpt2-medium's
shape, saved locally with save_pretrained): transformers' from_pretrained on every rank vs
`zeroshard.integrations.hf.from_pretrained` at stage 3, 4 CPU ranks.

Each variant runs in fresh processes (torchrun); the figure is the rise of the process's peak RSS
(ru_maxrss) over its RSS just before the load, per rank. The checkpoint is written once to
--path (default /tmp/zeroshard-bench-gpt2-medium).

    python bench/bench_hf_load.py [--ranks 4] [--layers 24] [--width 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

STAGE3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def gpt2_config(layers: int, width: int):
    """gpt2-medium's shape by default (24 layers, width 1024, 50257 tokens)."""
    import transformers
    return transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                   vocab_size=50257, n_positions=1024)


def save(path: str, layers: int, width: int) -> None:
    """Write the checkpoint once (random weights: only sizes matter here)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return
    import torch
    import transformers
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(gpt2_config(layers, width)).save_pretrained(path)


def worker(variant: str, path: str, out: str) -> None:
    """Load once and write this rank's peak RSS rise and what it holds."""
    import resource

    import psutil
    import torch

    import zeroshard
    from zeroshard.core.layout import INIT_ATTR
    from zeroshard.integrations import hf
    import transformers

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    before = psutil.Process().memory_info().rss
    if variant == "zeroshard":
        model = hf.from_pretrained(path, config=STAGE3)
    else:
        model = transformers.GPT2LMHeadModel.from_pretrained(path)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # transformers' load leaves parameters backed by the memory-mapped file: pages become
    # resident when first read (the first forward). Read every element to count them.
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(getattr(p, INIT_ATTR)[0].shard.numel() * p.element_size()
                if hasattr(p, INIT_ATTR) else p.numel() * p.element_size()
                for p in model.parameters())
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    with open(f"{out}/rank{os.environ['RANK']}.json", "w") as fh:
        json.dump({"rise": peak - before, "rise_loaded": loaded - before, "held": shard, "psi": psi}, fh)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--path", default="/tmp/zeroshard-bench-gpt2-medium")
    args = parser.parse_args()
    save(args.path, args.layers, args.width)
    mib = 2**20
    block = 12 * args.width ** 2 * 4  # one transformer block's parameters, fp32 bytes
    embed = 50257 * args.width * 4
    for variant in ("normal", "zeroshard"):
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", str(args.ranks), __file__, "--worker",
                                   variant, args.path, out], capture_output=True, text=True)
            try:  # a result written before an abort at exit (gloo teardown) still counts
                ranks = [json.load(open(f"{out}/rank{r}.json")) for r in range(args.ranks)]
            except FileNotFoundError:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
        rises = ", ".join(f"{r['rise'] / mib:.0f}" for r in ranks)
        loaded = ", ".join(f"{r['rise_loaded'] / mib:.0f}" for r in ranks)
        print(f"{variant:9s} peak RSS rise per rank (MiB) after the load: {loaded}; once every "
              f"parameter was read: {rises}; holds "
              f"{max(r['held'] for r in ranks) / mib:.0f} MiB of parameters")
    psi = ranks[0]["psi"]
    print(f"model: {psi / 1e6:.0f} M parameters = {4 * psi / mib:.0f} MiB fp32; world size "
          f"{args.ranks}: shards {4 * psi / args.ranks / mib:.0f} MiB per rank; one block "
          f"{block / mib:.0f} MiB, the token embedding (largest unit) {embed / mib:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main()
