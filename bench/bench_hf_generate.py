"""Greedy `generate()` speed of a Hugging Face GPT-2 wrapped by an engine without an optimizer, 2 CPU
ranks, next to plain torch (the same model, no engine): stage 2 (parameters whole), stage 3 built
partitioned and built whole (the model gathered once per `generate` call while it fits in
stage3_max_live_parameters, core/generation.py), and stage 3 over that budget (every decode step
gathers unit by unit).

Each variant runs in fresh processes (torchrun); the figure is new tokens per second on rank 0
(median of --rounds generate calls after one warm-up), with the all-gather bytes per call.

    python bench/bench_hf_generate.py [--layers 12] [--width 768] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {  # name -> (zero_optimization or None for plain torch, built partitioned)
    "plain torch": (None, False),
    "stage 2": ({"stage": 2}, False),
    "stage 3, built partitioned": ({"stage": 3}, True),
    "stage 3, built whole": ({"stage": 3}, False),
    "stage 3, over the live budget": ({"stage": 3, "stage3_max_live_parameters": 1000,
                                       "stage3_max_reuse_distance": 0}, True),
}


def worker(variant: str, layers: int, width: int, tokens: int, rounds: int, out: str) -> None:
    """Build the model (partitioned at stage 3), wrap it, time generate."""
    import torch
    import transformers

    import zeroshard
    from zeroshard.integrations import hf

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    zero, partitioned = VARIANTS[variant]
    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": dict(zero or {}, stage3_param_persistence_threshold=0)}
    hf_config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                        vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    if partitioned:
        model = hf.from_config(hf_config, config=config)
    else:
        model = transformers.GPT2LMHeadModel(hf_config)
    if zero is None:
        engine = model.eval()
        engine.comm_report = lambda: {"all_gather": 0}
    else:
        engine, *_ = zeroshard.initialize(model=model, config=config)
        engine.eval()
    prompt = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    engine.generate(prompt, **kwargs)  # warm-up
    rates, moved = [], []
    for _ in range(rounds):
        before = engine.comm_report()["all_gather"]
        start = time.perf_counter()
        engine.generate(prompt, **kwargs)
        rates.append(tokens / (time.perf_counter() - start))
        moved.append(engine.comm_report()["all_gather"] - before)
    with open(f"{out}/rank{os.environ['RANK']}.json", "w") as fh:
        json.dump({"tokens_per_s": statistics.median(rates), "all_gather": moved[-1],
                   "psi": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}, fh)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    plain = None
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", __file__, "--worker", variant, str(args.layers),
                 str(args.width), str(args.tokens), str(args.rounds), out],
                capture_output=True, text=True)
            try:
                rank0 = json.load(open(f"{out}/rank0.json"))
            except FileNotFoundError:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
        plain = plain or rank0["tokens_per_s"]
        print(f"{variant:32s} {rank0['tokens_per_s']:7.2f} tokens/s "
              f"({rank0['tokens_per_s'] / plain:.2f}x plain torch); all-gather "
              f"{rank0['all_gather'] / 2**20:8.1f} MiB per generate call")
    print(f"model: {rank0['psi'] / 1e6:.0f} M parameters, {args.tokens} new tokens, batch 1, "
          "2 ranks, 1 thread each")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], *map(int, sys.argv[3:7]), sys.argv[7])
    else:
        main()
