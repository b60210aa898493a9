"""ZeRO++ accuracy: the demo GPT trained under plain stage 3 and with qwZ / qgZ; final losses.

World of 4 CPU (gloo) ranks laid out as 2 hosts x 2 ranks (LOCAL_WORLD_SIZE=2, as torchrun sets it
on two nodes), so qgZ's cross-host step runs. Every variant starts from the same weights and sees
the same batches (`zeroshard.cli.demo`'s model, data and config: fp32, AdamW lr 3e-3, micro batch
8, every parameter sharded, nothing kept gathered). Printed per variant: final training loss (mean
of the last 10 steps), the trained model's loss on held-out text (the 50,000 characters after the
training corpus, EVAL_BATCHES fixed batches, exact weights), each one's relative gap to plain
stage 3 (target: at most 1%), and the bytes one step sent per rank from the comm ledger, in total
and across hosts.

Two runs of this small model that differ by nothing that matters still end apart: the `jitter`
variant is plain stage 3 started from weights moved by one part in a million. Its gap is the
noise floor of the measure at that seed; run several `--seed`s and compare means.

    python bench/bench_zeropp_accuracy.py                # plain, qwZ, qgZ, both; 200 steps
    python bench/bench_zeropp_accuracy.py --steps 20 --variants plain,both          # smoke run
    python bench/bench_zeropp_accuracy.py --extra zero_hpz_partition_size=2
    python bench/bench_zeropp_accuracy.py --warmup 20   # lr ramps up over the first 20 steps

`--extra KEY=VALUE` (repeatable; VALUE read as JSON, else as a string) adds a `zero_optimization`
key to every variant but the plain baseline, and adds a variant with only the extra keys.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

VARIANTS = {
    "plain": {},
    "jitter": {"_jitter": 1e-6},  # control: plain, initial weights x (1 + 1e-6 * noise)
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "both": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
}
# The demo's stage-3 row: every parameter sharded, nothing kept gathered between uses.
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
TAIL = 10  # final loss: mean of the last TAIL steps
EVAL_CHARS = 50_000  # held-out text: this many characters after the training corpus
EVAL_BATCHES = 16  # of 32 sequences each
TARGET = 0.01


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(name: str, zero: dict, args) -> dict:
    """One variant on this rank: losses per step and the ledger's bytes of the last step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import zeroshard
    from zeroshard.cli.demo import (CORPUS_CHARS, GPTConfig, TinyGPT, batch_for_step, ds_config,
                                    encode, load_corpus)

    text = load_corpus(CORPUS_CHARS + EVAL_CHARS)
    data, held_out = encode(text[:CORPUS_CHARS]), encode(text[CORPUS_CHARS:])
    torch.manual_seed(args.seed)
    model = TinyGPT(GPTConfig())
    zero = dict(zero)
    jitter = zero.pop("_jitter", 0.0)
    if jitter:
        gen = torch.Generator().manual_seed(args.seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + jitter * torch.randn(p.shape, generator=gen))
    config = ds_config({**STAGE3, **zero}, args.micro_batch, args.lr)
    if args.warmup:  # linear warmup from 0 to --lr over the first --warmup steps (WarmupLR)
        config["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": args.lr, "warmup_num_steps": args.warmup,
            "warmup_type": "linear"}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    losses, step_s = [], []
    for step in range(args.steps):
        x, y = batch_for_step(data, step, engine.rank, engine.world_size, args.micro_batch,
                              model.cfg.block_size, args.seed)
        before = engine.comm_report()
        start = time.perf_counter()
        logits = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        step_s.append(time.perf_counter() - start)
        after = engine.comm_report()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / engine.world_size)
        if engine.rank == 0 and (step + 1) % 50 == 0:
            print(f"    {name}: step {step + 1}/{args.steps}, loss {losses[-1]:.4f}", flush=True)
    engine.destroy()  # leaves the model whole (at stage 3 its parameters are empty before)
    finite = all(p.isfinite().all().item() for p in model.parameters())
    return {"name": name, "zero": zero, "losses": losses, "finite": finite,
            "eval_loss": _evaluate(model, held_out),
            "bytes": {k: after[k] - before[k] for k in ("total", "intra_host", "inter_host")},
            "step_ms": 1e3 * sorted(step_s)[len(step_s) // 2]}


def _evaluate(model, held_out: torch.Tensor) -> float:
    """Mean loss of the (whole, exact) model on EVAL_BATCHES fixed batches of held-out text."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(12345)
    block = model.cfg.block_size
    total = 0.0
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            starts = torch.randint(0, held_out.numel() - block - 1, (32,), generator=gen).tolist()
            x = torch.stack([held_out[s:s + block] for s in starts])
            y = torch.stack([held_out[s + 1:s + 1 + block] for s in starts])
            logits = model(x)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    return total / EVAL_BATCHES


def _worker(rank: int, world: int, per_host: int, port: int, variants: dict, args, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
                      LOCAL_WORLD_SIZE=str(per_host), GROUP_RANK=str(rank // per_host),
                      ZEROSHARD_QUIET="1")
    torch.set_num_threads(1)
    import zeroshard

    zeroshard.init_distributed()
    results = []
    for name, zero in variants.items():
        results.append(_train(name, zero, args))
        if rank == 0:
            r = results[-1]
            print(f"  {name}: final loss {sum(r['losses'][-TAIL:]) / TAIL:.4f}, held-out "
                  f"{r['eval_loss']:.4f}, {r['step_ms']:.0f} ms/step", flush=True)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)


def _parse_extra(items: list[str]) -> dict:
    extra = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--extra {item!r}: expected KEY=VALUE")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    return extra


def table(results: list[dict]) -> list[str]:
    """Markdown rows: final and held-out loss and their gaps to plain, bytes per step per rank
    (total, inter-host)."""
    plain = next(r for r in results if r["name"] == "plain")
    base = sum(plain["losses"][-TAIL:]) / TAIL
    base_inter = plain["bytes"]["inter_host"]
    rows = ["| variant | final loss (mean of last 10) | gap | held-out loss | gap | "
            "bytes/step/rank | inter-host bytes/step/rank | inter-host vs plain | ms/step |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        final = sum(r["losses"][-TAIL:]) / TAIL
        gaps = [(final - base) / base, (r["eval_loss"] - plain["eval_loss"]) / plain["eval_loss"]]
        shown = [f"{100 * g:+.3f}%" + ("" if abs(g) <= TARGET and r["finite"] else " (over)")
                 for g in gaps]
        rows.append(f"| {r['name']} | {final:.4f} | {shown[0]} | {r['eval_loss']:.4f} | "
                    f"{shown[1]} | {r['bytes']['total']:,} | {r['bytes']['inter_host']:,} | "
                    f"{r['bytes']['inter_host'] / base_inter:.3f}x | {r['step_ms']:.0f} |")
    return rows


def main(argv=None) -> int:
    """Run the variants in one spawned world and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (plain always runs)")
    parser.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                        help="zero_optimization key added to every variant but plain")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=0,
                        help="linear learning-rate warmup over this many steps (WarmupLR); 0: "
                             "the demo's constant rate from step 0")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--json", help="also write the per-step losses and bytes here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    extra = _parse_extra(args.extra)
    variants = {"plain": {}}
    if extra:
        variants["+".join(f"{k}={v}" for k, v in extra.items())] = dict(extra)
    for name in names:
        if name == "jitter":  # the control stays plain
            variants[name] = VARIANTS[name]
        elif name != "plain":
            label = name + "".join(f"+{k}={v}" for k, v in extra.items())
            variants[label] = {**VARIANTS[name], **extra}
    print(f"ZeRO++ accuracy: demo GPT, {args.steps} steps, lr {args.lr:g}"
          + (f" (linear warmup over {args.warmup})" if args.warmup else "")
          + f", {args.world} ranks as "
          f"{args.world // args.per_host} hosts x {args.per_host}, variants: {', '.join(variants)}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(args.world, args.per_host, _port(), variants, args, out),
                           nprocs=args.world, start_method="spawn")
        with open(out) as fh:
            results = json.load(fh)
    print("\n".join(table(results)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if all(r["finite"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
