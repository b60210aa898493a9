"""Side-by-side ZeRO benchmark: zeroshard vs DeepSpeed, DDP, ZeroRedundancyOptimizer and FSDP2.

Every implementation trains the same GPT-2-style model (built from a config, fp32, dropout 0) on the
same random token ids with AdamW(lr=1e-4, weight_decay=0), two ranks on the gloo backend. Each
implementation runs as its own ``torchrun --nproc-per-node 2`` job, so every run has fresh processes
and its own peak RSS. The driver interleaves the implementations over rounds (the order is shuffled
from round 2 on) to spread machine noise, then prints a markdown table.

    python bench/bench_zero.py                       # 3 rounds x every implementation
    python bench/bench_zero.py --rounds 1 --impls ddp,deepspeed-s2 --steps 4
    python bench/bench_zero.py --summarize bench/results/latest.json   # re-print a saved run

The same file is the worker (``--worker``); the driver launches it through torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name -> (family, stage). The stage is the ZeRO stage whose state sharding the implementation matches;
# it selects the DeepSpeed run used for the "vs DeepSpeed" ratio (None: no DeepSpeed counterpart).
IMPLS = {
    "zeroshard-s0": ("zeroshard", 0),
    "zeroshard-s1": ("zeroshard", 1),
    "zeroshard-s2": ("zeroshard", 2),
    "zeroshard-s3": ("zeroshard", 3),
    "deepspeed-s1": ("deepspeed", 1),
    "deepspeed-s2": ("deepspeed", 2),
    "deepspeed-s3": ("deepspeed", 3),
    "ddp": ("ddp", None),
    "zero-redundancy-optimizer": ("zero-redundancy-optimizer", 1),
    "fsdp2": ("fsdp2", 3),
}
# Not in the default set: DDP with gradient_as_bucket_view=True (grads are views into DDP's buckets,
# so the extra bucket copy of the gradients disappears). Useful to judge how much of the DDP
# baseline is DDP's own bucket memory. And DeepSpeed stage 3 given zeroshard's STAGE3 knobs
# (deepspeed-s3 itself runs at DeepSpeed's defaults, as its users get it).
EXTRA_IMPLS = {"ddp-gbv": ("ddp", None), "deepspeed-s3-bounded": ("deepspeed", 3)}
ALL_IMPLS = {**IMPLS, **EXTRA_IMPLS}

WORLD_SIZE = 2
LR = 1e-4
MODEL_KW = dict(n_layer=8, n_embd=768, n_head=12, n_positions=128)
# A byte-sized vocabulary puts the tied embedding at 0.2 M params, for ~57.0 M parameters in total.
VOCAB = 256
# zeroshard's stage-3 knobs (elements). DeepSpeed's defaults (1e9 live, 1e9 reuse distance) keep
# every parameter of a model this size gathered for the whole step, which is stage 2 with extra
# gathers. These hold about two blocks (7.1 M each): the one running and the one prefetched, and
# keep the last block of forward for the first of backward. deepspeed-s3 runs at DeepSpeed's own
# defaults; deepspeed-s3-bounded gets these same knobs.
STAGE3 = {"stage3_prefetch_bucket_size": 8_000_000, "stage3_max_live_parameters": 16_000_000,
          "stage3_max_reuse_distance": 8_000_000}
BENCH_DIR = Path(__file__).resolve().parent


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        **MODEL_KW,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
    )


def count_params() -> int:
    """Unique parameter count (the tied embedding / LM head counted once), without allocating."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config())
    return sum(p.numel() for p in model.parameters())


def zero_config(args, stage: int, for_deepspeed: bool) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": int(args.bucket)}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = int(args.bucket)
    if stage == 3 and (not for_deepspeed or args.impl == "deepspeed-s3-bounded"):
        zero.update(STAGE3)
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if for_deepspeed:
        # We hand DeepSpeed the same torch AdamW instance every implementation uses, so that it
        # never selects one of its own (JIT-compiled) optimizers. torch AdamW is on DeepSpeed's list
        # of ZeRO-tested optimizers and nothing is offloaded here, so these two keys change nothing
        # in this configuration; they keep the run working if an offload or another torch optimizer
        # is tried (DeepSpeed otherwise asserts / demands DeepSpeedCPUAdam).
        cfg["zero_allow_untested_optimizer"] = True
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


# --------------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------------


def _rss_now_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    family, stage = ALL_IMPLS[args.impl]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])

    if family == "deepspeed":
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
    elif family == "zeroshard":
        import zeroshard  # initialize() sets up gloo from the torchrun environment itself
    else:
        dist.init_process_group("gloo")

    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(gpt2_config())
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    n_total = args.warmup + args.steps
    batches = [
        torch.randint(0, VOCAB, (args.micro_batch, args.seq_len), generator=g) for _ in range(n_total)
    ]

    memory_report = None
    if family == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, gradient_as_bucket_view=(args.impl == "ddp-gbv"))
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


    elif family == "zero-redundancy-optimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=0.0
        )


    elif family == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


    elif family == "deepspeed":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=zero_config(args, stage, for_deepspeed=True)
        )


    elif family == "zeroshard":
        cfg = zero_config(args, stage, for_deepspeed=False)
        if args.zeroshard_optimizer == "config":
            opt = None
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=opt, config=cfg)


    else:  # pragma: no cover - guarded by argparse choices
        raise ValueError(args.impl)

    if family in ("deepspeed", "zeroshard"):

        def train_step(x, marks):
            loss = engine(input_ids=x, labels=x).loss
            marks.append(time.perf_counter())
            engine.backward(loss)
            marks.append(time.perf_counter())
            engine.step()
            return loss

    else:

        def train_step(x, marks):
            loss = model(input_ids=x, labels=x).loss
            marks.append(time.perf_counter())
            loss.backward()
            marks.append(time.perf_counter())
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    rss_after_setup = _rss_now_mib()
    import psutil

    setup_s = time.time() - psutil.Process().create_time()
    # Phases are wall-clock slices of the timed step, with no extra synchronisation: collectives
    # issued from backward hooks count as backward, those issued by the optimizer step as step.
    times, phases, losses = [], [], []
    for i, x in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        marks = [t0]
        loss = train_step(x, marks)
        marks.append(time.perf_counter())
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            times.append(marks[-1] - t0)
            phases.append([b - a for a, b in zip(marks, marks[1:])])
    dist.barrier()

    if family == "zeroshard" and hasattr(engine, "memory_report"):
        try:
            memory_report = engine.memory_report()
        except Exception as exc:  # report, don't hide
            memory_report = {"error": repr(exc)}

    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    result = {
        "impl": args.impl,
        "round": args.round,
        "rank": rank,
        "world_size": world,
        "n_params": n_params,
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "phase_times_s": phases,  # per timed step: [forward, backward, optimizer step]
        "peak_rss_mib": peak_rss_mib,
        "rss_after_setup_mib": rss_after_setup,
        "setup_s": setup_s,
        "final_loss": losses[-1],
        "losses": losses,
        "threads": torch.get_num_threads(),
        "memory_report": memory_report,
    }
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------


def launch(args, impl: str, rnd: int, run_dir: Path) -> tuple[bool, float, str, list[float]]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(WORLD_SIZE),
        str(Path(__file__).resolve()), "--worker",
        "--impl", impl, "--round", str(rnd), "--run-dir", str(run_dir),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--bucket", str(args.bucket),
        "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
        "--seed", str(args.seed), "--threads", str(args.threads),
        "--zeroshard-optimizer", args.zeroshard_optimizer,
    ]  # fmt: skip
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.malloc_mmap_threshold is not None:
        # Fixes glibc's mmap threshold (disabling its dynamic growth), so that large freed blocks go
        # back to the OS instead of staying in the heap; see bench/README.md.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    log_path = run_dir / "log.txt"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    load.append(os.getloadavg()[0])
    ok = rc == 0 and all((run_dir / f"rank{r}.json").exists() for r in range(WORLD_SIZE))
    tail = ""
    if not ok:
        text = log_path.read_text(errors="replace").splitlines()
        tail = f"rc={rc}\n" + "\n".join(text[-40:])
    return ok, wall, tail, load


def load_run(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def summarize(args, impls, runs, failures, n_params, wall_total) -> str:
    """runs: impl -> list of per-run rank lists."""
    med = statistics.median
    row = {}
    for impl in impls:
        rs = runs.get(impl, [])
        if not rs:
            continue
        steps = [max(r["median_step_s"] for r in ranks) for ranks in rs]
        rss = med([max(r["peak_rss_mib"] for r in ranks) for ranks in rs])
        losses = [r["final_loss"] for r in rs[-1]]
        load = max(max(ranks[0].get("loadavg_1min_before_after", [0.0])) for ranks in rs)
        row[impl] = {"step": med(steps), "best": min(steps), "rss": rss, "losses": losses,
                     "runs": len(rs), "load": load}

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "—"

    psi = n_params
    mib = 2**20
    saving = {1: 4 * psi, 2: 6 * psi, 3: 8 * psi}  # fp32 Adam, N=2 (bytes saved per rank vs DDP)
    ddp = row.get("ddp")
    z0 = row.get("zeroshard-s0")

    import torch

    try:
        import deepspeed

        ds_ver = deepspeed.__version__
    except Exception:
        ds_ver = "not installed"
    lines = [
        f"# zeroshard bench — GPT-2 {MODEL_KW['n_layer']}x{MODEL_KW['n_embd']}, "
        f"Ψ = {psi:,} params, fp32, AdamW(lr={LR:g})",
        "",
        f"world size {WORLD_SIZE} (gloo, CPU, {args.threads} thread/rank), micro batch "
        f"{args.micro_batch} x {args.seq_len} tokens per rank, {args.warmup} warm-up + {args.steps} "
        f"timed steps, bucket (reduce/allgather) = {args.bucket:.0e} elements, {args.rounds} round(s); "
        f"torch {torch.__version__}, deepspeed {ds_ver}; glibc MALLOC_MMAP_THRESHOLD_ "
        f"{args.malloc_mmap_threshold if args.malloc_mmap_threshold is not None else 'dynamic (default)'}; "
        f"total wall {wall_total / 60:.1f} min",
        "",
        "| impl | step ms | vs deepspeed same stage | vs zeroshard-s0 | best-round ms | peak RSS MiB/rank "
        "| vs ddp RSS | ddp − RSS MiB | final loss (rank 0, 1) | runs | max load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for impl in impls:
        if impl not in row:
            lines.append(f"| {impl} | FAILED | | | | | | | | 0 | |")
            continue
        r = row[impl]
        stage = ALL_IMPLS[impl][1]
        ds = row.get(f"deepspeed-s{stage}") if stage else None
        vs_ds = ratio(r["step"], ds["step"]) if ds else "—"
        vs_z0 = ratio(r["step"], z0["step"]) if z0 else "—"
        vs_ddp = ratio(r["rss"], ddp["rss"]) if ddp else "—"
        diff = f"{ddp['rss'] - r['rss']:.0f}" if ddp else "—"
        loss = ", ".join(f"{x:.6f}" for x in r["losses"])
        lines.append(
            f"| {impl} | {r['step'] * 1e3:.0f} | {vs_ds} | {vs_z0} | {r['best'] * 1e3:.0f} "
            f"| {r['rss']:.0f} | {vs_ddp} | {diff} | {loss} | {r['runs']} | {r['load']:.1f} |"
        )
    lines += [
        "",
        "step ms: per run, median over the timed steps on each rank, max over ranks; then median over "
        "rounds (best-round ms: the minimum over rounds instead; contention from other jobs only ever "
        "adds time). Peak RSS: ru_maxrss of each worker process, max over ranks, median over rounds. "
        "'same stage' maps zero-redundancy-optimizer to deepspeed-s1 and fsdp2 to deepspeed-s3. "
        "max load: highest 1-minute load average seen at the start or end of this impl's runs (the "
        f"benchmark's own {WORLD_SIZE} ranks account for ~{WORLD_SIZE}; more means other jobs shared "
        f"the {os.cpu_count()} CPUs and the times are inflated).",
        "",
        "Theoretical saving per rank vs DDP (fp32 AdamW, N=2; DDP = 4Ψ params + 4Ψ grads + 8Ψ Adam "
        f"state = {16 * psi / mib:.0f} MiB): stage 1 saves 4Ψ = {saving[1] / mib:.0f} MiB, stage 2 "
        f"saves 6Ψ = {saving[2] / mib:.0f} MiB, stage 3 saves 8Ψ = {saving[3] / mib:.0f} MiB.",
        "",
        "## Targets",
        "",
    ]

    def verdict(ok):
        return "PASS" if ok else "FAIL"

    def rss_target(s, z, base_rss, base_name):
        """One target line: zeroshard-s<s> peak RSS <= base - 0.9 x the stage's theoretical saving."""
        limit = base_rss - 0.9 * saving[s] / mib
        return (f"- zeroshard-s{s} peak RSS {z['rss']:.0f} MiB <= {base_name} {base_rss:.0f} − 0.9 x "
                f"{saving[s] / mib:.0f} = {limit:.0f} MiB: {verdict(z['rss'] <= limit)} "
                f"(measured saving {base_rss - z['rss']:.0f} MiB = "
                f"{(base_rss - z['rss']) / (saving[s] / mib):.0%} of theoretical)")

    for s in (1, 2):
        z = row.get(f"zeroshard-s{s}")
        ds = row.get(f"deepspeed-s{s}")
        if z is None:
            lines.append(f"- zeroshard-s{s}: not measured")
            continue
        for other, name, bound in ((ds, f"deepspeed-s{s}", 0.8), (z0, "zeroshard-s0", 1.05)):
            if other:
                lines.append(
                    f"- zeroshard-s{s} step time {z['step'] * 1e3:.0f} ms <= {bound} x {name} "
                    f"({bound * other['step'] * 1e3:.0f} ms): {verdict(z['step'] <= bound * other['step'])} "
                    f"({z['step'] / other['step']:.2f}x); best rounds {z['best'] * 1e3:.0f} vs "
                    f"{other['best'] * 1e3:.0f} ms: {verdict(z['best'] <= bound * other['best'])} "
                    f"({z['best'] / other['best']:.2f}x)"
                )
        if ddp:
            lines.append(rss_target(s, z, ddp["rss"], "DDP"))

    z3 = row.get("zeroshard-s3")
    if z3 is None:
        lines.append("- zeroshard-s3: not measured")
    else:
        for name, bound in (("deepspeed-s3", 0.8), ("fsdp2", 1.0)):
            other = row.get(name)
            if other:
                lines.append(
                    f"- zeroshard-s3 step time {z3['step'] * 1e3:.0f} ms <= {bound} x {name} "
                    f"({bound * other['step'] * 1e3:.0f} ms): {verdict(z3['step'] <= bound * other['step'])} "
                    f"({z3['step'] / other['step']:.2f}x); best rounds {z3['best'] * 1e3:.0f} vs "
                    f"{other['best'] * 1e3:.0f} ms: {verdict(z3['best'] <= bound * other['best'])} "
                    f"({z3['best'] / other['best']:.2f}x)")
        if ddp:
            lines.append(rss_target(3, z3, ddp["rss"], "DDP"))

    base = row.get("ddp-gbv")
    if base:
        lines.append("")
        lines.append("Informational, against DDP with gradient_as_bucket_view=True (no separate 4Ψ "
                     f"bucket copy of the gradients; peak {base['rss']:.0f} MiB):")
        for s in (1, 2, 3):
            z = row.get(f"zeroshard-s{s}")
            if z:
                lines.append(rss_target(s, z, base["rss"], "DDP-gbv"))

    # Loss agreement. Same init and same data everywhere, so the first step's loss (before any
    # update) must match to rounding. After that, reduction order differs between implementations and
    # Adam's first updates (~lr * sign(g)) turn rounding noise in near-zero gradients into whole
    # lr-sized steps, so later losses drift apart at the 1e-3 level: check them with a looser tolerance.
    if row:
        ref_impl = "ddp" if "ddp" in row else next(iter(row))
        ref_runs = runs[ref_impl][-1]
        first = final = 0.0
        for impl in row:
            for a, b in zip(runs[impl][-1], ref_runs):
                first = max(first, abs(a["losses"][0] - b["losses"][0]) / abs(b["losses"][0]))
                final = max(final, abs(a["final_loss"] - b["final_loss"]) / abs(b["final_loss"]))
        lines += [
            "",
            f"- first-step losses agree (same init and data; max relative difference vs {ref_impl} "
            f"{first:.1e} <= 1e-6): {verdict(first <= 1e-6)}",
            f"- final losses agree (max relative difference vs {ref_impl} over ranks and impls "
            f"{final:.1e} <= {args.loss_rtol:g}): {verdict(final <= args.loss_rtol)}",
        ]
    phase_rows = []
    for impl in row:
        per_run = []
        for ranks in runs[impl]:
            ph = [r.get("phase_times_s") for r in ranks]
            if not all(ph):
                break
            # per rank: median over timed steps of each phase; per run: the slowest rank's phases
            meds = [[med(col) for col in zip(*p)] for p in ph]
            per_run.append(max(meds, key=sum))
        else:
            if per_run:
                phase_rows.append((impl, [med(col) for col in zip(*per_run)]))
    if phase_rows:
        lines += ["", "## Where the step time goes (ms; slowest rank's per-step medians, median over rounds)",
                  "", "| impl | forward | backward | optimizer step |", "|---|---:|---:|---:|"]
        for impl, (f, b, o) in phase_rows:
            lines.append(f"| {impl} | {f * 1e3:.0f} | {b * 1e3:.0f} | {o * 1e3:.0f} |")
        lines.append("")
        lines.append("Backward includes collectives launched from gradient hooks (DDP, stage 2, "
                     "FSDP2), the optimizer step those launched by the step (stage 1's reduce-scatter, "
                     "the parameter all-gathers).")

    ledgers = [(impl, runs[impl][-1][0].get("memory_report")) for impl in row
               if ALL_IMPLS[impl][0] == "zeroshard"]
    ledgers = [(i, m) for i, m in ledgers if isinstance(m, dict) and "params" in m]
    if ledgers:
        lines += ["", "## zeroshard memory ledger (engine.memory_report(), rank 0, MiB, all placements)",
                  "", "| impl | params | grads | optimizer | buffers | total |", "|---|---:|---:|---:|---:|---:|"]
        for impl, m in ledgers:
            vals = [sum(m.get(k, {}).values()) / mib for k in ("params", "grads", "optimizer", "buffers")]
            lines.append(f"| {impl} | " + " | ".join(f"{v:.0f}" for v in vals) + f" | {sum(vals):.0f} |")
    for impl, msg in failures.items():
        lines += ["", f"### {impl} failed", "", "```", msg.strip(), "```"]
    return "\n".join(lines) + "\n"


def resummarize(args) -> None:
    """Print the table again from a saved latest.json (e.g. after the targets changed)."""
    saved = json.loads(Path(args.summarize).read_text())
    impls = [i for i in saved["args"]["impls"].split(",") if i]
    for key, value in saved["args"].items():
        if key not in ("summarize",):
            setattr(args, key, value)
    print(summarize(args, impls, saved["runs"], saved["failures"], saved["n_params"], 0.0))


def driver(args) -> None:
    impls = [s for s in args.impls.split(",") if s]
    unknown = [s for s in impls if s not in ALL_IMPLS]
    if unknown:
        sys.exit(f"unknown impl(s) {unknown}; choose from {list(ALL_IMPLS)}")
    out = Path(args.out)
    runs_dir = out / "runs"
    n_params = count_params()
    runs: dict[str, list] = {}
    failures: dict[str, str] = {}
    t_start = time.perf_counter()
    for rnd in range(1, args.rounds + 1):
        order = list(impls)
        if rnd > 1:
            random.Random(args.seed + rnd).shuffle(order)
        for impl in order:
            run_dir = runs_dir / f"round{rnd}-{impl}"
            ok, wall, tail, load = launch(args, impl, rnd, run_dir)
            if ok:
                ranks = load_run(run_dir)
                for r in ranks:
                    r["loadavg_1min_before_after"] = load
                    r["wall_s"] = wall
                runs.setdefault(impl, []).append(ranks)
                step = max(r["median_step_s"] for r in ranks)
                rss = max(r["peak_rss_mib"] for r in ranks)
                print(
                    f"round {rnd} {impl:26s} step {step * 1e3:7.0f} ms  peak RSS {rss:6.0f} MiB  "
                    f"loss {ranks[0]['final_loss']:.6f}  ({wall:.0f} s, load {load[0]:.1f}->{load[1]:.1f})",
                    flush=True,
                )
            else:
                failures[impl] = tail
                print(f"round {rnd} {impl:26s} FAILED ({wall:.0f} s)\n{tail}", flush=True)
    wall_total = time.perf_counter() - t_start
    table = summarize(args, impls, runs, failures, n_params, wall_total)
    print()
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.md").write_text(table)
    (out / "latest.json").write_text(
        json.dumps({"args": vars(args), "n_params": n_params, "runs": runs, "failures": failures},
                   indent=1)
    )  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated; default all of {list(IMPLS)}; extra: {list(EXTRA_IMPLS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    p.add_argument("--bucket", type=float, default=1e7,
                   help="reduce_bucket_size = allgather_bucket_size (elements), zeroshard and DeepSpeed")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per torchrun job")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ for the workers (default: glibc's dynamic threshold)")
    p.add_argument("--loss-rtol", type=float, default=5e-3)
    p.add_argument("--zeroshard-optimizer", choices=["instance", "config"], default="instance",
                   help="pass zeroshard a torch AdamW instance, or the DeepSpeed-style optimizer config")
    p.add_argument("--summarize", metavar="LATEST_JSON",
                   help="only print the table again from a saved results/latest.json")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=list(ALL_IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)  # fmt: skip


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    elif a.summarize:
        resummarize(a)
    else:
        driver(a)
