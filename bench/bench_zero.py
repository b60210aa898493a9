"""The complete peer benchmark: zeroshard vs DeepSpeed, DDP, ZeroRedundancyOptimizer and FSDP2.

Every implementation trains the same GPT-2-style model (built from a config, fp32, dropout 0) on the
same random token ids with AdamW(lr=1e-4, weight_decay=0), two ranks on the gloo backend, at two
model sizes (`small` ~3.3 M and `large` ~57 M parameters). Each implementation runs as its own
``torchrun --nproc-per-node 2`` job, so every run has fresh processes and its own peak RSS. Per size,
the driver interleaves the implementations over rounds (the order is shuffled from round 2 on) to
spread machine noise, then prints one markdown table per size: step time, peak RSS, communication
bytes per step and the ratios against the peers.

    python bench/bench_zero.py                       # both sizes x every implementation (~20 min, 2 cores)
    python bench/bench_zero.py --sizes small --rounds 1 --steps 2      # smoke run, every row
    python bench/bench_zero.py --sizes large --impls ddp,deepspeed-s2,zeroshard-s2 --rounds 1
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
from collections import Counter, defaultdict
from pathlib import Path

# name -> (family, stage). The stage is the ZeRO stage whose state sharding the implementation matches;
# with the "-offload" suffix it selects the DeepSpeed run used for the "vs DeepSpeed" ratio
# (None: no DeepSpeed counterpart).
IMPLS = {
    "zeroshard-s0": ("zeroshard", 0),
    "zeroshard-s1": ("zeroshard", 1),
    "zeroshard-s2": ("zeroshard", 2),
    "zeroshard-s2-offload": ("zeroshard", 2),
    "zeroshard-s3": ("zeroshard", 3),
    "deepspeed-s1": ("deepspeed", 1),
    "deepspeed-s2": ("deepspeed", 2),
    "deepspeed-s2-offload": ("deepspeed", 2),
    "deepspeed-s3": ("deepspeed", 3),
    "ddp": ("ddp", None),
    "zero-redundancy-optimizer": ("zero-redundancy-optimizer", 1),
    "fsdp2-reshard": ("fsdp2", 3),
    "fsdp2-noreshard": ("fsdp2", 3),
}
# Not in the default set: DDP with gradient_as_bucket_view=True (grads are views into DDP's buckets,
# so the extra bucket copy of the gradients disappears). Useful to judge how much of the DDP
# baseline is DDP's own bucket memory. And DeepSpeed stage 3 given zeroshard's stage-3 knobs
# (deepspeed-s3 itself runs at DeepSpeed's defaults, as its users get it).
EXTRA_IMPLS = {"ddp-gbv": ("ddp", None), "deepspeed-s3-bounded": ("deepspeed", 3)}
ALL_IMPLS = {**IMPLS, **EXTRA_IMPLS}
# Old names still accepted by --impls.
ALIASES = {"fsdp2": "fsdp2-reshard"}

WORLD_SIZE = 2
LR = 1e-4
# A byte-sized vocabulary keeps the tied embedding small, so almost all parameters are in the blocks.
VOCAB = 256
# Per size: the model, the default rounds / timed steps / warm-up steps, and zeroshard's stage-3
# knobs (elements). DeepSpeed's defaults (1e9 live, 1e9 reuse distance) keep every parameter of
# models this size gathered for the whole step, which is stage 2 with extra gathers. The knobs hold
# about two blocks: the one running and the one prefetched (prefetch ~1.13 blocks, live ~2.25
# blocks, reuse distance ~1.13 blocks), and keep the last block of forward for the first of
# backward. deepspeed-s3 runs at DeepSpeed's own defaults; deepspeed-s3-bounded gets these knobs.
#   small: 4 blocks of 789,760 elements (12 d^2 + 13 d, d = 256), Ψ = 3,257,856
#   large: 8 blocks of 7,087,872 elements (d = 768), Ψ = 56,999,424
SIZES = {
    "small": {
        "model": dict(n_layer=4, n_embd=256, n_head=4, n_positions=128),
        "rounds": 3, "steps": 10, "warmup": 2,
        "stage3": {"stage3_prefetch_bucket_size": 900_000, "stage3_max_live_parameters": 1_800_000,
                   "stage3_max_reuse_distance": 900_000},
    },
    "large": {
        "model": dict(n_layer=8, n_embd=768, n_head=12, n_positions=128),
        "rounds": 2, "steps": 5, "warmup": 1,
        "stage3": {"stage3_prefetch_bucket_size": 8_000_000, "stage3_max_live_parameters": 16_000_000,
                   "stage3_max_reuse_distance": 8_000_000},
    },
}
BENCH_DIR = Path(__file__).resolve().parent


def offloaded(impl: str) -> bool:
    return impl.endswith("-offload")


def ds_peer(impl: str) -> str | None:
    """The DeepSpeed run at the same stage (and placement) that `impl` is compared with."""
    stage = ALL_IMPLS[impl][1]
    if not stage:
        return None
    return f"deepspeed-s{stage}-offload" if offloaded(impl) else f"deepspeed-s{stage}"


def gpt2_config(size: str):
    from transformers import GPT2Config

    return GPT2Config(
        **SIZES[size]["model"],
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
    )


def count_params(size: str) -> int:
    """Unique parameter count (the tied embedding / LM head counted once), without allocating."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(size))
    return sum(p.numel() for p in model.parameters())


def zero_config(args, stage: int, for_deepspeed: bool) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": int(args.bucket)}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = int(args.bucket)
    if stage == 3 and (not for_deepspeed or args.impl == "deepspeed-s3-bounded"):
        zero.update(SIZES[args.size]["stage3"])
    if offloaded(args.impl):
        zero["offload_optimizer"] = {"device": "cpu"}
    if not for_deepspeed and args.desync == "off":
        zero["zeroshard_desync_timeout"] = 0
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if for_deepspeed:
        # Without offload we hand DeepSpeed the same torch AdamW instance every implementation uses,
        # so that it never selects one of its own (JIT-compiled) optimizers. torch AdamW is on
        # DeepSpeed's list of ZeRO-tested optimizers, so these two keys change nothing there; with
        # offload DeepSpeed gets its DeepSpeedCPUAdam (see worker), which they also allow.
        cfg["zero_allow_untested_optimizer"] = True
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


# --------------------------------------------------------------------------------------------------
# collective counter
# --------------------------------------------------------------------------------------------------


def _tensor_bytes(x) -> int:
    """Bytes of every tensor in `x` (a tensor or nested lists / tuples of them)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def ring_bytes(namespace: str, op: str, args: tuple, world: int) -> tuple[str, float]:
    """(kind, bytes this rank moves) for one `c10d::` or `_c10d_functional::` op, under the ring
    model the ZeRO paper uses and zeroshard's own ledger follows: all-gather and reduce-scatter move
    (N-1)/N of the full (gathered / unreduced) payload, all-reduce twice that, broadcast and reduce
    (N-1)/N of the payload; a point-to-point send counts its payload, a receive nothing (the
    sender counted it)."""
    n = world
    f = (n - 1) / n
    name = op.strip("_")
    if namespace == "_c10d_functional":
        if name.startswith("all_reduce"):
            return "all_reduce", 2 * f * _tensor_bytes(args[0])
        if name.startswith("all_gather_into_tensor"):
            g = int(args[1])
            return "all_gather", (g - 1) * _tensor_bytes(args[0])  # inputs, 1/g of the output
        if name.startswith("reduce_scatter_tensor"):
            g = int(args[2])
            return "reduce_scatter", (g - 1) / g * _tensor_bytes(args[0])
        if name.startswith("broadcast"):
            return "broadcast", f * _tensor_bytes(args[0])
        if name.startswith("all_to_all"):
            return "all_to_all", f * _tensor_bytes(args[0])
        if name == "wait_tensor":
            return "sync", 0.0
        return "other", float(_tensor_bytes(args))
    if name in ("allreduce", "allreduce_coalesced"):
        return "all_reduce", 2 * f * _tensor_bytes(args[0])
    if name in ("allgather", "allgather_coalesced", "allgather_into_tensor_coalesced"):
        return "all_gather", (n - 1) * _tensor_bytes(args[1])  # inputs, each 1/N of the output
    if name == "allgather_base":
        return "all_gather", f * _tensor_bytes(args[0])  # the gathered output
    if name in ("reduce_scatter", "reduce_scatter_tensor_coalesced"):
        return "reduce_scatter", (n - 1) * _tensor_bytes(args[0])  # outputs, each 1/N of the input
    if name == "reduce_scatter_base":
        return "reduce_scatter", f * _tensor_bytes(args[1])  # the unreduced input
    if name in ("broadcast", "reduce"):
        return name, f * _tensor_bytes(args[0])
    if name == "send":
        return "p2p", float(_tensor_bytes(args[0]))
    if name in ("recv", "recv_any_source"):
        return "p2p", 0.0
    if name in ("barrier", "monitored_barrier"):
        return "sync", 0.0
    if name in ("alltoall", "alltoall_base"):
        return "all_to_all", f * _tensor_bytes(args[1])
    return "other", float(_tensor_bytes(args))


def collective_counter(world: int):
    """A TorchDispatchMode that records every c10d collective issued while it is active.

    Every torch.distributed collective, whether called from Python (DeepSpeed, FSDP2,
    ZeroRedundancyOptimizer, zeroshard) or from C++ (DDP's reducer), goes through a `c10d::` op of
    the dispatcher, so a dispatch mode sees it with its tensors. Every aten op also passes through
    Python while the mode is active, so it is used only for one extra, untimed step.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = defaultdict(float)
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional"):
                op = func._schema.name.split("::")[-1]
                kind, nbytes = ring_bytes(func.namespace, op, args, world)
                self.bytes[kind] += nbytes
                self.calls[f"{func.namespace}::{op}"] += 1
            return func(*args, **(kwargs or {}))

        def summary(self) -> dict:
            out = {k: int(round(v)) for k, v in self.bytes.items()}
            out["total"] = sum(out.values())
            return {"bytes": out, "calls": dict(self.calls)}

    return CollectiveCounter()


# --------------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------------


def per_unit_guard(comm) -> None:
    """The desync check zeroshard had before its watchdog, for comparison (`--desync per-unit`):
    before every stage-3 unit all-gather and reduce-scatter, a blocking 24-byte tag all-gather on
    a side gloo group, compared on the host."""
    import torch
    import torch.distributed as dist

    from zeroshard.dist.comm import _ALL_GATHER

    group = dist.new_group(backend="gloo")
    count = [0]

    def check(kind: int, unit) -> None:
        count[0] += 1
        mine = torch.tensor([kind, getattr(unit, "index", -1), count[0]], dtype=torch.int64)
        every = torch.empty(3 * comm.world_size, dtype=torch.int64)
        _ALL_GATHER(every, mine, group=group)
        rows = every.view(comm.world_size, 3).tolist()
        if any(row != rows[0] for row in rows):
            raise RuntimeError(f"desynchronised: {rows}")

    for kind, name in enumerate(("all_gather", "reduce_scatter")):
        plain = getattr(comm, name)

        def guarded(*args, _plain=plain, _kind=kind, unit=None, **kwargs):
            check(_kind, unit)
            return _plain(*args, unit=unit, **kwargs)

        setattr(comm, name, guarded)


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
    model = GPT2LMHeadModel(gpt2_config(args.size))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    n_total = args.warmup + args.steps
    # One batch more than the measured steps: the comm-counting step after them.
    batches = [
        torch.randint(0, VOCAB, (args.micro_batch, args.seq_len), generator=g)
        for _ in range(n_total + 1)
    ]

    memory_report = None
    engine = None
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

        reshard = args.impl == "fsdp2-reshard"
        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    elif family == "deepspeed":
        if offloaded(args.impl):
            # DeepSpeed's ZeRO-Offload steps on the CPU with its own C++ Adam (the cpu_adam op,
            # JIT-built with ninja on first use and cached under ~/.cache/torch_extensions).
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0, adamw_mode=True)
        else:
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
        if args.desync == "per-unit" and stage == 3:
            per_unit_guard(engine.comm)

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

    def ledger_total():
        return engine.comm_report()["total"] if family == "zeroshard" else None

    rss_after_setup = _rss_now_mib()
    import psutil

    setup_s = time.time() - psutil.Process().create_time()
    # Phases are wall-clock slices of the timed step, with no extra synchronisation: collectives
    # issued from backward hooks count as backward, those issued by the optimizer step as step.
    # CPU time: time.process_time() of this process (all its threads, user + sys) over the step. Unlike
    # the wall clock it does not grow while the process waits for a core, so it stays readable when
    # other jobs share the machine (waiting for the peer in a collective costs little of it).
    times, cpu_times, phases, losses = [], [], [], []
    ledger_before = None
    for i, x in enumerate(batches[:n_total]):
        if i == args.warmup:
            ledger_before = ledger_total()
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        marks = [t0]
        loss = train_step(x, marks)
        marks.append(time.perf_counter())
        c1 = time.process_time()
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            times.append(marks[-1] - t0)
            cpu_times.append(c1 - c0)
            phases.append([b - a for a, b in zip(marks, marks[1:])])
    dist.barrier()
    ledger_after = ledger_total()
    # The high-water mark and the ledger are taken before the counting step below, which runs every
    # op through Python.
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    if family == "zeroshard" and hasattr(engine, "memory_report"):
        try:
            memory_report = engine.memory_report()
        except Exception as exc:  # report, don't hide
            memory_report = {"error": repr(exc)}

    comm = {"ledger_bytes_per_step": None, "counted": None, "ledger_counting_step": None}
    if ledger_before is not None:
        comm["ledger_bytes_per_step"] = (ledger_after - ledger_before) / args.steps
    if not args.no_comm_count:
        # One extra step with every c10d collective counted (same for every implementation; for
        # zeroshard it cross-checks the engine's own ledger over the same step).
        counter = collective_counter(world)
        before = ledger_total()
        with counter:
            train_step(batches[n_total], [])
        dist.barrier()
        comm["counted"] = counter.summary()
        if before is not None:
            comm["ledger_counting_step"] = ledger_total() - before

    result = {
        "impl": args.impl,
        "size": args.size,
        "round": args.round,
        "rank": rank,
        "world_size": world,
        "n_params": n_params,
        "median_step_s": statistics.median(times),
        "step_times_s": times,
        "median_cpu_s": statistics.median(cpu_times),
        "cpu_times_s": cpu_times,
        "phase_times_s": phases,  # per timed step: [forward, backward, optimizer step]
        "peak_rss_mib": peak_rss_mib,
        "rss_after_setup_mib": rss_after_setup,
        "setup_s": setup_s,
        "final_loss": losses[-1],
        "losses": losses,
        "threads": torch.get_num_threads(),
        "memory_report": memory_report,
        "comm": comm,
    }
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------


def plan_for(args, size: str) -> dict:
    """Rounds, timed steps and warm-up steps for one size: the command line's, else the size's."""
    return {k: getattr(args, k) if getattr(args, k) is not None else SIZES[size][k]
            for k in ("rounds", "steps", "warmup")}


def _busy_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_idle(max_wait: float) -> float:
    """Wait (up to max_wait s) until other processes use under half a core; returns seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait:
        b0, c0 = _busy_cpu_s(), time.perf_counter()
        time.sleep(2.0)
        if (_busy_cpu_s() - b0) / (time.perf_counter() - c0) < 0.5:
            break
    return time.perf_counter() - t0


def launch(args, size: str, plan: dict, impl: str, rnd: int, run_dir: Path):
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(WORLD_SIZE),
        str(Path(__file__).resolve()), "--worker",
        "--impl", impl, "--size", size, "--round", str(rnd), "--run-dir", str(run_dir),
        "--steps", str(plan["steps"]), "--warmup", str(plan["warmup"]), "--bucket", str(args.bucket),
        "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
        "--seed", str(args.seed), "--threads", str(args.threads),
        "--zeroshard-optimizer", args.zeroshard_optimizer, "--desync", args.desync,
    ] + (["--no-comm-count"] if args.no_comm_count else [])  # fmt: skip
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = str(args.threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.malloc_mmap_threshold is not None:
        # Fixes glibc's mmap threshold (disabling its dynamic growth), so that large freed blocks go
        # back to the OS instead of staying in the heap; see bench/README.md.
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if args.wait_idle:
        wait_idle(args.wait_idle)
    load = [os.getloadavg()[0]]
    busy0, mine0 = _busy_cpu_s(), _children_cpu_s()
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
    # Cores kept busy by other processes during the job, on average: the machine's busy CPU time
    # minus this job's own (torchrun and its workers, all waited for), over the job's wall time.
    load.append(max(0.0, (_busy_cpu_s() - busy0 - (_children_cpu_s() - mine0)) / wall))
    # A run counts when every rank wrote its results, even if the job then exited non-zero (a crash
    # in interpreter / process-group teardown, after the measurement); that exit is reported as a note.
    ok = all((run_dir / f"rank{r}.json").exists() for r in range(WORLD_SIZE))
    tail = ""
    if rc != 0:
        text = log_path.read_text(errors="replace").splitlines()
        tail = f"rc={rc}\n" + "\n".join(text[-40:] if not ok else text[:3])
    return ok, wall, tail, load


def load_run(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def _comm_of(ranks: list[dict]) -> dict:
    """Per run: bytes per step per rank (max over ranks) from the zeroshard ledger and the c10d count."""
    out = {}
    ledger = [r.get("comm", {}).get("ledger_bytes_per_step") for r in ranks]
    if all(v is not None for v in ledger):
        out["ledger"] = max(ledger)
    same = [r.get("comm", {}).get("ledger_counting_step") for r in ranks]
    if all(v is not None for v in same):
        out["ledger_same_step"] = max(same)
    counted = [r.get("comm", {}).get("counted") for r in ranks]
    if all(counted):
        worst = max(counted, key=lambda c: c["bytes"]["total"])
        out["counted"] = worst["bytes"]["total"]
        out["counted_kinds"] = worst["bytes"]
        out["calls"] = worst["calls"]
    return out


def summarize(args, size: str, plan: dict, impls, runs, failures, n_params, wall_total, h="##",
              exit_notes=None) -> str:
    """One size's tables. runs: impl -> list of per-run rank lists."""
    med = statistics.median
    mib = 2**20
    row = {}
    for impl in impls:
        rs = runs.get(impl, [])
        if not rs:
            continue
        steps = [max(r["median_step_s"] for r in ranks) for ranks in rs]
        cpu = [max(r.get("median_cpu_s", float("nan")) for r in ranks) for ranks in rs]
        rss = med([max(r["peak_rss_mib"] for r in ranks) for ranks in rs])
        losses = [r["final_loss"] for r in rs[-1]]
        la = [ranks[0].get("loadavg_1min_before_after", [0.0]) for ranks in rs]
        load = max(max(x[:2]) for x in la)
        foreign = max(x[2] for x in la) if all(len(x) > 2 for x in la) else float("nan")
        comms = [_comm_of(ranks) for ranks in rs]
        comm = {}
        for key in ("ledger", "ledger_same_step", "counted"):
            vals = [c[key] for c in comms if key in c]
            if vals:
                comm[key] = med(vals)
        last = next((c for c in reversed(comms) if "counted_kinds" in c), None)
        if last:
            comm["counted_kinds"], comm["calls"] = last["counted_kinds"], last["calls"]
        comm["value"] = comm.get("ledger", comm.get("counted"))
        row[impl] = {"step": med(steps), "best": min(steps), "cpu": med(cpu), "rss": rss, "losses": losses,
                     "runs": len(rs), "load": load, "foreign": foreign, "comm": comm}

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "—"

    psi = n_params
    saving = {1: 4 * psi, 2: 6 * psi, 3: 8 * psi}  # fp32 Adam, N=2 (bytes saved per rank vs DDP)
    ddp = row.get("ddp")
    z0 = row.get("zeroshard-s0")
    z3 = row.get("zeroshard-s3")
    model = SIZES[size]["model"]

    import torch

    try:
        import deepspeed

        ds_ver = deepspeed.__version__
    except Exception:
        ds_ver = "not installed"
    lines = [
        f"{h} {size}: GPT-2 {model['n_layer']}x{model['n_embd']}, Ψ = {psi:,} params, fp32, "
        f"AdamW(lr={LR:g})",
        "",
        f"world size {WORLD_SIZE} (gloo, CPU, {args.threads} thread/rank), micro batch "
        f"{args.micro_batch} x {args.seq_len} tokens per rank, {plan['warmup']} warm-up + "
        f"{plan['steps']} timed steps, bucket (reduce/allgather) = {args.bucket:.0e} elements, "
        f"{plan['rounds']} round(s); torch {torch.__version__}, deepspeed {ds_ver}; glibc "
        f"MALLOC_MMAP_THRESHOLD_ "
        f"{args.malloc_mmap_threshold if args.malloc_mmap_threshold is not None else 'dynamic (default)'}; "
        f"wall {wall_total / 60:.1f} min",
        "",
        "| impl | step ms | best-round ms | CPU ms/step/rank | peak RSS MiB/rank | comm MiB/step/rank "
        "| step vs DeepSpeed same stage | RSS vs DeepSpeed same stage | step vs ddp | RSS vs ddp "
        "| step vs zeroshard-s3 | RSS vs zeroshard-s3 | final loss (rank 0, 1) | runs | max load "
        "| other jobs, cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for impl in impls:
        if impl not in row:
            lines.append(f"| {impl} | FAILED | | | | | | | | | | | | 0 | | |")
            continue
        r = row[impl]
        peer = ds_peer(impl)
        ds = row.get(peer) if peer else None
        fsdp = ALL_IMPLS[impl][0] == "fsdp2"
        c = r["comm"].get("value")
        cells = [
            f"{r['step'] * 1e3:.0f}", f"{r['best'] * 1e3:.0f}", f"{r['cpu'] * 1e3:.0f}", f"{r['rss']:.0f}",
            f"{c / mib:.1f}" if c is not None else "n/a",
            ratio(r["step"], ds["step"]) if ds else "—", ratio(r["rss"], ds["rss"]) if ds else "—",
            ratio(r["step"], ddp["step"]) if ddp else "—", ratio(r["rss"], ddp["rss"]) if ddp else "—",
            ratio(r["step"], z3["step"]) if fsdp and z3 else "—",
            ratio(r["rss"], z3["rss"]) if fsdp and z3 else "—",
            ", ".join(f"{x:.6f}" for x in r["losses"]), str(r["runs"]), f"{r['load']:.1f}",
            f"{r['foreign']:.2f}",
        ]
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "step ms: per run, median over the timed steps on each rank, max over ranks; then median over "
        "rounds (best-round ms: the minimum over rounds instead; contention from other jobs only ever "
        "adds time). CPU ms: the process's CPU time (all threads, user + sys) per timed step, same "
        "median / max / median; it does not grow while a rank waits for a core, so it is the column to "
        "read when the load column is well above 2. Peak RSS: ru_maxrss of each worker process "
        "after the timed steps, max over ranks, median over rounds. comm: bytes this rank moved per step under the ring model, "
        "zeroshard rows from `engine.comm_report()['total']` over the timed steps, other rows "
        "counted at the c10d dispatcher over one extra step (see the communication table). "
        "'same stage': zeroshard-sK and deepspeed-s3-bounded vs deepspeed-sK, the -offload rows vs "
        "deepspeed-s2-offload, zero-redundancy-optimizer vs deepspeed-s1, fsdp2-* vs deepspeed-s3. "
        "max load: highest 1-minute load average seen at the start or end of this impl's runs (the "
        f"benchmark's own {WORLD_SIZE} ranks account for ~{WORLD_SIZE}; more means other jobs shared "
        f"the {os.cpu_count()} CPUs and the times are inflated). other jobs, cores: the machine's busy "
        "CPU time during the run (/proc/stat) minus the run's own (its process tree), over its wall "
        "time, max over rounds: how many cores other processes took on average (0 on an idle "
        "machine, 2 = both cores).",
        "",
        "Theoretical saving per rank vs DDP (fp32 AdamW, N=2; DDP = 4Ψ params + 4Ψ grads + 8Ψ Adam "
        f"state = {16 * psi / mib:.0f} MiB): stage 1 saves 4Ψ = {saving[1] / mib:.0f} MiB, stage 2 "
        f"saves 6Ψ = {saving[2] / mib:.0f} MiB, stage 3 saves 8Ψ = {saving[3] / mib:.0f} MiB. "
        f"Ring-model traffic per rank and step (fp32, N=2): DDP and stages 0-2 4Ψ = "
        f"{4 * psi / mib:.1f} MiB (all-reduce, or reduce-scatter + all-gather), stage 3 6Ψ = "
        f"{6 * psi / mib:.1f} MiB (one more all-gather).",
        "",
        f"{h}# Targets ({size})",
        "",
    ]

    def verdict(ok):
        return "PASS" if ok else "FAIL"

    def step_target(name_z, z, name_o, other, bound):
        return (f"- {name_z} step time {z['step'] * 1e3:.0f} ms <= {bound} x {name_o} "
                f"({bound * other['step'] * 1e3:.0f} ms): {verdict(z['step'] <= bound * other['step'])} "
                f"({z['step'] / other['step']:.2f}x); best rounds {z['best'] * 1e3:.0f} vs "
                f"{other['best'] * 1e3:.0f} ms: {verdict(z['best'] <= bound * other['best'])} "
                f"({z['best'] / other['best']:.2f}x)")

    def rss_target(s, z, base_rss, base_name, name=None):
        """One target line: zeroshard-s<s> peak RSS <= base - 0.9 x the stage's theoretical saving."""
        limit = base_rss - 0.9 * saving[s] / mib
        return (f"- {name or f'zeroshard-s{s}'} peak RSS {z['rss']:.0f} MiB <= {base_name} "
                f"{base_rss:.0f} − 0.9 x {saving[s] / mib:.0f} = {limit:.0f} MiB: "
                f"{verdict(z['rss'] <= limit)} (measured saving {base_rss - z['rss']:.0f} MiB = "
                f"{(base_rss - z['rss']) / (saving[s] / mib):.0%} of theoretical)")

    for s in (1, 2):
        z = row.get(f"zeroshard-s{s}")
        if z is None:
            lines.append(f"- zeroshard-s{s}: not measured")
            continue
        for name, bound in ((f"deepspeed-s{s}", 0.8), ("zeroshard-s0", 1.05)):
            if row.get(name):
                lines.append(step_target(f"zeroshard-s{s}", z, name, row[name], bound))
        if ddp:
            lines.append(rss_target(s, z, ddp["rss"], "DDP"))
    if z3 is None:
        lines.append("- zeroshard-s3: not measured")
    else:
        for name, bound in (("deepspeed-s3", 0.8), ("fsdp2-reshard", 1.0), ("fsdp2-noreshard", 1.0)):
            if row.get(name):
                lines.append(step_target("zeroshard-s3", z3, name, row[name], bound))
        if ddp:
            lines.append(rss_target(3, z3, ddp["rss"], "DDP"))
    zo, dso = row.get("zeroshard-s2-offload"), row.get("deepspeed-s2-offload")
    if zo and dso:
        lines.append("- informational: " + step_target("zeroshard-s2-offload", zo,
                                                       "deepspeed-s2-offload", dso, 1.0)[2:])
        lines.append(f"- informational: zeroshard-s2-offload peak RSS {zo['rss']:.0f} MiB vs "
                     f"deepspeed-s2-offload {dso['rss']:.0f} MiB ({zo['rss'] / dso['rss']:.2f}x)")

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

    comm_rows = [(impl, row[impl]["comm"]) for impl in row if row[impl]["comm"].get("counted") is not None
                 or row[impl]["comm"].get("ledger") is not None]
    if comm_rows:
        kinds = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p"]
        lines += [
            "", f"{h}# Communication per step and rank ({size}; MiB, ring model)", "",
            "| impl | table value | c10d count, extra step | " + " | ".join(kinds)
            + " | other | zeroshard ledger, same extra step | collective calls in the extra step |",
            "|---|---:|---:|" + "---:|" * (len(kinds) + 2) + "---|",
        ]
        for impl, c in comm_rows:
            kb = c.get("counted_kinds", {})
            known = sum(kb.get(k, 0) for k in kinds) + kb.get("sync", 0)
            other = kb.get("total", 0) - known if kb else None
            calls = ", ".join(f"{k.split('::')[-1]} {v}" for k, v in sorted(c.get("calls", {}).items()))
            src = "ledger" if c.get("ledger") is not None else "c10d count"
            cells = [f"{c['value'] / mib:.2f} ({src})" if c.get("value") is not None else "n/a",
                     f"{c['counted'] / mib:.2f}" if c.get("counted") is not None else "n/a"]
            cells += [f"{kb.get(k, 0) / mib:.2f}" if kb else "" for k in kinds]
            cells += [f"{other / mib:.2f}" if other is not None else "",
                      f"{c['ledger_same_step'] / mib:.2f}"
                      if c.get("ledger_same_step") is not None else "—",
                      calls]
            lines.append(f"| {impl} | " + " | ".join(cells) + " |")
        lines += ["", "c10d count: a TorchDispatchMode in the worker sees every `c10d::` op (DDP's "
                  "C++ reducer, DeepSpeed, FSDP2, ZeroRedundancyOptimizer and zeroshard all issue "
                  "their collectives through them) during one extra step after the timed ones, and "
                  "adds the op's ring-model bytes; the zeroshard ledger column is "
                  "`comm_report()['total']` over that same step, for cross-checking. Small sync "
                  "collectives (DeepSpeed's overflow / norm all-reduces, DDP's bucket rebuild) are "
                  "included."]

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
        lines += ["", f"{h}# Where the step time goes ({size}; ms; slowest rank's per-step medians, "
                  "median over rounds)", "", "| impl | forward | backward | optimizer step |",
                  "|---|---:|---:|---:|"]
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
        lines += ["", f"{h}# zeroshard memory ledger ({size}; engine.memory_report(), rank 0, MiB, "
                  "all placements)", "", "| impl | params | grads | optimizer | buffers | total |",
                  "|---|---:|---:|---:|---:|---:|"]
        for impl, m in ledgers:
            vals = [sum(m.get(k, {}).values()) / mib for k in ("params", "grads", "optimizer", "buffers")]
            lines.append(f"| {impl} | " + " | ".join(f"{v:.0f}" for v in vals) + f" | {sum(vals):.0f} |")
    for impl, msg in failures.items():
        lines += ["", f"{h}# {impl} failed ({size})", "", "```", msg.strip(), "```"]
    if exit_notes:
        lines += ["", f"{h}# Runs that exited non-zero after writing their results ({size})", "",
                  "Their measurements are counted; the job's exit status and first log lines:", ""]
        for note in exit_notes:
            lines += [f"- {note['impl']}, round {note['round']}: " + " / ".join(
                x.strip() for x in note["log"].splitlines() if x.strip())]
    return "\n".join(lines) + "\n"


def report(args, saved: dict, h: str = "##") -> str:
    """Every size's tables; `h` is the heading level of each size's section."""
    parts = [f"{h[1:] or '#'} zeroshard peer benchmark", ""]
    total = saved.get("wall_total_s")
    if total:
        parts += [f"Sizes {', '.join(saved['sizes'])}; total wall {total / 60:.1f} min.", ""]
    for size, s in saved["sizes"].items():
        parts.append(summarize(args, size, s["plan"], s["impls"], s["runs"], s["failures"],
                               s["n_params"], s["wall_s"], h, s.get("exit_notes")))
    return "\n".join(parts)


def resummarize(args) -> None:
    """Print the tables again from a saved latest.json (e.g. after the targets changed)."""
    saved = json.loads(Path(args.summarize).read_text())
    if "sizes" not in saved:
        sys.exit("this latest.json predates the per-size format; rerun the benchmark")
    for key, value in saved["args"].items():
        if key not in ("summarize",):
            setattr(args, key, value)
    print(report(args, saved))


def driver(args) -> None:
    impls = [ALIASES.get(s, s) for s in args.impls.split(",") if s]
    unknown = [s for s in impls if s not in ALL_IMPLS]
    if unknown:
        sys.exit(f"unknown impl(s) {unknown}; choose from {list(ALL_IMPLS)}")
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        sys.exit(f"unknown size(s) {bad}; choose from {list(SIZES)}")
    out = Path(args.out)
    saved = {"args": vars(args), "sizes": {}}
    t_start = time.perf_counter()
    for size in sizes:
        plan = plan_for(args, size)
        runs_dir = out / "runs" / size
        n_params = count_params(size)
        runs: dict[str, list] = {}
        failures: dict[str, str] = {}
        exit_notes: list[dict] = []
        t_size = time.perf_counter()
        print(f"== {size}: Ψ = {n_params:,}, {plan['rounds']} round(s) x {len(impls)} impls, "
              f"{plan['warmup']} warm-up + {plan['steps']} timed steps", flush=True)
        for rnd in range(1, plan["rounds"] + 1):
            order = list(impls)
            if rnd > 1:
                random.Random(args.seed + rnd).shuffle(order)
            for impl in order:
                run_dir = runs_dir / f"round{rnd}-{impl}"
                ok, wall, tail, load = launch(args, size, plan, impl, rnd, run_dir)
                if ok and tail:
                    exit_notes.append({"impl": impl, "round": rnd, "log": tail})
                    print(f"{size} round {rnd} {impl}: exited {tail.splitlines()[0]} after writing "
                          "its results (counted)", flush=True)
                if ok:
                    ranks = load_run(run_dir)
                    for r in ranks:
                        r["loadavg_1min_before_after"] = load
                        r["wall_s"] = wall
                    runs.setdefault(impl, []).append(ranks)
                    step = max(r["median_step_s"] for r in ranks)
                    rss = max(r["peak_rss_mib"] for r in ranks)
                    comm = _comm_of(ranks)
                    c = comm.get("ledger", comm.get("counted"))
                    print(
                        f"{size} round {rnd} {impl:26s} step {step * 1e3:7.0f} ms  peak RSS "
                        f"{rss:6.0f} MiB  comm {c / 2**20 if c is not None else float('nan'):7.2f} "
                        f"MiB/step  loss {ranks[0]['final_loss']:.6f}  ({wall:.0f} s, load "
                        f"{load[0]:.1f}->{load[1]:.1f}, other jobs {load[2]:.2f} cores)",
                        flush=True,
                    )
                else:
                    failures[impl] = tail
                    print(f"{size} round {rnd} {impl:26s} FAILED ({wall:.0f} s)\n{tail}", flush=True)
        saved["sizes"][size] = {"plan": plan, "impls": impls, "n_params": n_params, "runs": runs,
                                "failures": failures, "exit_notes": exit_notes,
                                "wall_s": time.perf_counter() - t_size}
    saved["wall_total_s"] = time.perf_counter() - t_start
    table = report(args, saved)
    print()
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.md").write_text(table)
    (out / "latest.json").write_text(json.dumps(saved, indent=1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default=",".join(SIZES),
                   help=f"comma-separated model sizes, default all of {list(SIZES)}")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds per size (default: small 3, large 2)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated; default all of {list(IMPLS)}; extra: {list(EXTRA_IMPLS)}")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per run (default: small 10, large 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before the timed ones (default: small 2, large 1)")
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
    p.add_argument("--desync", choices=["watchdog", "off", "per-unit"], default="watchdog",
                   help="zeroshard's desync detection: the watchdog (default, free in steady "
                        "state), off (zeroshard_desync_timeout=0), or per-unit: the check before "
                        "the watchdog, a blocking tag all-gather before every stage-3 unit "
                        "collective (emulated here, for comparison)")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each job, wait up to this long until other processes use < 0.5 core")
    p.add_argument("--no-comm-count", action="store_true",
                   help="skip the extra step that counts every c10d collective")
    p.add_argument("--summarize", metavar="LATEST_JSON",
                   help="only print the tables again from a saved results/latest.json")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=list(ALL_IMPLS), help=argparse.SUPPRESS)
    p.add_argument("--size", choices=list(SIZES), default="large", help=argparse.SUPPRESS)
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
