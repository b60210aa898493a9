"""Greedy `generate()` speed of a Hugging Face GPT-2 wrapped by an engine (no optimizer unless said),
2 CPU ranks, paired with plain torch: in each variant's processes the same model without an engine
and the engine's model generate in turn (a barrier before each), and the figure is the median over
the rounds of plain time / engine time, so both sides see the same machine load. Variants: stage 2
(parameters whole); stage 3 built whole and built partitioned (the model gathered once per
`generate` call while it fits in stage3_max_live_parameters, compat/hf/generation.py); stage 3 between
training steps (an AdamW engine taking one untimed step before each round, as a fine-tuning loop
that generates between steps); stage 3 with the calls inside `engine.gathered_model()` (one gather
for all, held by the caller); stage 3 over the budget (each decode step gathers).

    python bench/bench_hf_generate.py [--layers 12] [--width 768] [--tokens 32 128] [--rounds 8]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {  # name -> (zero_optimization, built partitioned, most rounds)
    "stage 2": ({"stage": 2}, False, None),
    "stage 3, built whole": ({"stage": 3}, False, None),
    "stage 3, built partitioned": ({"stage": 3}, True, None),
    # Fine-tuning with generation between steps: an AdamW engine, one training step per round.
    "stage 3, between training steps": ({"stage": 3}, False, None),
    # Many short generations: one gather for all of them, held by the caller.
    "stage 3, inside gathered_model()": ({"stage": 3}, False, None),
    # About 6x slower than the others: two rounds tell its ratio.
    "stage 3, over the live budget": ({"stage": 3, "stage3_max_live_parameters": 1000,
                                       "stage3_max_reuse_distance": 0}, True, 2),
}


def _timed(fn) -> float:
    import torch

    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(variant: str, layers: int, width: int, lengths: list[int], rounds: int,
           out: str) -> None:
    """Build plain torch's model and the engine's (partitioned at stage 3 if asked), time both."""
    import torch
    import transformers

    import zeroshard
    from zeroshard.integrations import hf

    torch.set_num_threads(1)
    zeroshard.init_distributed()
    zero, partitioned, most = VARIANTS[variant]
    rounds = min(rounds, most or rounds)
    training = variant.endswith("training steps")
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "zero_optimization": dict(zero, stage3_param_persistence_threshold=0)}
    if training:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5}}
    hf_config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                        vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(hf_config).eval()
    model = hf.from_config(hf_config, config=config) if partitioned else copy.deepcopy(plain)
    engine, *_ = zeroshard.initialize(model=model, config=config)
    engine.eval()
    prompt = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(1))
    batch = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(2))

    def train_step():  # not timed: what a fine-tuning loop does between generations
        engine.train()
        engine.backward(engine(batch, labels=batch).loss)
        engine.step()
        engine.eval()

    results = {}
    inside = variant.endswith("gathered_model()")
    with engine.gathered_model() if inside else contextlib.nullcontext():
        for tokens in lengths:
            results[tokens] = _pair(plain, engine, prompt, tokens, rounds,
                                    train_step if training else None)
    if os.environ["RANK"] == "0":
        with open(f"{out}/rank0.json", "w") as fh:
            json.dump({"results": results, "psi": sum(p.numel() for p in plain.parameters())}, fh)
    torch.distributed.destroy_process_group()


def _pair(plain, engine, prompt, tokens: int, rounds: int, between=None) -> dict:
    """Plain torch and the engine generating `tokens` new tokens in turn, `rounds` times
    (`between`, if given, runs untimed before each round)."""
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    plain.generate(prompt, **kwargs)  # warm-up
    engine.generate(prompt, **kwargs)
    plain_s, engine_s, ratios = [], [], []
    for _ in range(rounds):
        if between is not None:
            between()
        plain_s.append(_timed(lambda: plain.generate(prompt, **kwargs)))
        before = engine.comm_report()["all_gather"]
        engine_s.append(_timed(lambda: engine.generate(prompt, **kwargs)))
        moved = engine.comm_report()["all_gather"] - before
        ratios.append(plain_s[-1] / engine_s[-1])
    return {"plain": tokens / statistics.median(plain_s),
            "engine": tokens / statistics.median(engine_s),
            "ratio": statistics.median(ratios), "all_gather": moved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    print(f"{'engine':32s} {'new tokens':>10s} {'plain tok/s':>11s} {'engine tok/s':>12s} "
          f"{'paired ratio':>12s} {'all-gather MiB/call':>20s}")
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", __file__, "--worker", variant, str(args.layers),
                 str(args.width), ",".join(map(str, args.tokens)), str(args.rounds), out],
                capture_output=True, text=True)
            try:
                rank0 = json.load(open(f"{out}/rank0.json"))
            except FileNotFoundError:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
        for tokens, row in rank0["results"].items():
            print(f"{variant:32s} {tokens:>10s} {row['plain']:11.1f} {row['engine']:12.1f} "
                  f"{row['ratio']:11.2f}x {row['all_gather'] / 2**20:20.1f}")
    print(f"model: {rank0['psi'] / 1e6:.0f} M parameters, batch 1, 2 ranks, 1 thread each; "
          f"median of {args.rounds} paired rounds (2 over the live budget)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
               [int(t) for t in sys.argv[5].split(",")], int(sys.argv[6]), sys.argv[7])
    else:
        main()
