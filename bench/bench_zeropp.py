"""ZeRO++ on a simulated two-host cluster: step time and inter-host bytes, zeroshard vs DeepSpeed.

Two simulated hosts of two ranks each (tests/cluster.py: network namespaces on a bridge), every
variant a real multi-node job, one agent per host:

    zeroshard run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 10.213.0.1:29400 --rdzv-id zpp bench/bench_zeropp.py --worker ...

over two links: `unlimited` and `1gbit` (tc tbf at 1 Gbit/s on each host's uplink, its egress to
the other host; traffic inside a host goes over its loopback, unlimited). Variants are named
`zero_optimization` sections (VARIANTS): zeroshard stage 3 plain, + hpZ, + qwZ, + qgZ, all three,
DeepSpeed stage 3 and DeepSpeed stage 3 with the same ZeRO++ keys, plus `compute-only`: every rank
runs the same step on its own whole model (torch AdamW, no ZeRO, no collective inside the step)
while the other three do the same, so the four ranks share the two cores as in the real jobs.

Per job each rank writes its step times (median over the timed steps), its CPU time per step, its
losses and, for zeroshard, `engine.comm_report()` over the timed steps; local rank 0 of each host
also writes what the host's uplink (GLOO_SOCKET_IFNAME) sent between the barrier after the
warm-up steps and the barrier after the last timed step (/proc/net/dev: the namespace's own, wire
bytes with every header). The driver adds up the hosts and prints one markdown table per link.

    python bench/bench_zeropp.py                                   # everything, one round
    python bench/bench_zeropp.py --variants zeroshard-s3,deepspeed-s3 --links 1gbit --steps 5
    python bench/bench_zeropp.py --summarize bench/results/zeropp.json

Needs root and iproute2 (network namespaces, tc). DeepSpeed rows run under `--ds-python` (default
/work/ds-venv/bin/python when the driver's Python has no deepspeed), DS_ACCELERATOR=cpu, gloo.
Every job's namespaces are deleted when it ends, times out, fails or the driver is interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
from bench_zero import _busy_cpu_s, _children_cpu_s, wait_idle  # noqa: E402

HOSTS, PER_HOST = 2, 2
PORT = 29400
LINKS = {"unlimited": None, "1gbit": "1gbit"}  # tc rate units: gbit = 10^9 bit/s
HPZ = {"zero_hpz_partition_size": PER_HOST}
QWZ = {"zero_quantized_weights": True}
QGZ = {"zero_quantized_gradients": True}
ZPP = {**HPZ, **QWZ, **QGZ}
# name -> (family, ZeRO++ keys added to the common stage-3 section). Adding a variant is one line.
VARIANTS = {
    "zeroshard-s3": ("zeroshard", {}),
    "zeroshard-s3-hpz": ("zeroshard", HPZ),
    "zeroshard-s3-qwz": ("zeroshard", QWZ),
    "zeroshard-s3-qgz": ("zeroshard", QGZ),
    "zeroshard-s3-zpp": ("zeroshard", ZPP),
    "deepspeed-s3": ("deepspeed", {}),
    "deepspeed-s3-zpp": ("deepspeed", ZPP),
    "compute-only": ("compute", {}),  # run once per round, on the first link given
}
# Not run by default: DeepSpeed with one ZeRO++ component at a time (which of them runs on CPU).
EXTRA_VARIANTS = {"deepspeed-s3-hpz": ("deepspeed", HPZ), "deepspeed-s3-qwz": ("deepspeed", QWZ),
                  "deepspeed-s3-qgz": ("deepspeed", QGZ)}
ALL_VARIANTS = {**VARIANTS, **EXTRA_VARIANTS}
BASE, DS_BASE, ALL3, COMPUTE = "zeroshard-s3", "deepspeed-s3", "zeroshard-s3-zpp", "compute-only"
LR = 3e-4
TARGETS = {"bytes": 0.25, "step": 0.5, "step_vs_ds": 0.8}  # issue 18, all three vs plain / DS s3


def model_config(args):
    """The demo's GPT (zeroshard.cli.demo.TinyGPT) at the bench's size."""
    from zeroshard.cli.demo import GPTConfig

    return GPTConfig(vocab_size=128, block_size=args.seq_len, d_model=args.width,
                     n_layer=args.layers, n_head=args.width // 64)


def block_elements(args) -> int:
    """Parameters of one transformer block (12 d^2 + 13 d: qkv, proj, fc, out, two LayerNorms)."""
    d = args.width
    return 12 * d * d + 13 * d


def zero_section(args, extra: dict) -> dict:
    """Stage 3 with every parameter sharded and released after use (3 x Psi a step, as the ZeRO++
    paper's baseline), one block prefetched; the same knobs for zeroshard and DeepSpeed."""
    block = block_elements(args)
    return {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": block, "stage3_max_live_parameters": 3 * block,
            "reduce_bucket_size": 2 * block, **extra}


def ds_config(args, family: str, extra: dict) -> dict:
    """The config both engines get (DeepSpeed's format); DeepSpeed keeps the torch AdamW given."""
    cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
           "steps_per_print": 10**9, "zero_optimization": zero_section(args, extra)}
    if family == "deepspeed":
        cfg["zero_allow_untested_optimizer"] = True
        cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


# --------------------------------------------------------------------------------------------------
# worker (one rank of one job)
# --------------------------------------------------------------------------------------------------


def link_counters() -> tuple[int, int]:
    """(sent, received) bytes of this host's inter-host interface (this namespace's own)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "zsnet")
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == ifname:
            values = fields.split()
            return int(values[8]), int(values[0])
    raise KeyError(f"no interface {ifname} in /proc/net/dev")


def worker(args) -> None:
    """Build, train warm-up + timed steps, write rank<R>.json into the run directory."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    family, extra = ALL_VARIANTS[args.variant]
    if family == "deepspeed":
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zeroshard

        zeroshard.init_distributed(backend="gloo")
    from zeroshard.cli.demo import TinyGPT, batch_for_step, encode, load_corpus

    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank, node = int(os.environ["LOCAL_RANK"]), int(os.environ["GROUP_RANK"])
    torch.manual_seed(args.seed)
    model = TinyGPT(model_config(args))
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    engine = None
    if family == "deepspeed":
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                          config=ds_config(args, family, extra))
    elif family == "zeroshard":
        engine, *_ = zeroshard.initialize(model=model, optimizer=opt,
                                          config=ds_config(args, family, extra))
    data = encode(load_corpus())

    def step(i: int) -> float:
        x, y = batch_for_step(data, i, rank, world, args.micro_batch, args.seq_len, args.seed)
        if engine is None:  # compute-only: this rank's whole model, nothing communicated
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
            engine.backward(loss)
            engine.step()
        return float(loss.detach())

    def ledger():
        return engine.comm_report() if family == "zeroshard" else None

    times, cpu, losses = [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            dist.barrier()
            link0, ledger0 = link_counters(), ledger()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        losses.append(step(i))
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    dist.barrier()
    link1, ledger1 = link_counters(), ledger()
    result = {
        "variant": args.variant, "link": args.link, "round": args.round, "rank": rank,
        "node": node, "local_rank": local_rank, "world": world, "psi": psi,
        "step_times_s": times, "median_step_s": statistics.median(times),
        "median_cpu_s": statistics.median(cpu), "losses": losses, "final_loss": losses[-1],
        "link_sent": link1[0] - link0[0], "link_received": link1[1] - link0[1],
        "ledger": {k: ledger1[k] - ledger0[k] for k in ledger1} if ledger1 else None,
    }
    (Path(args.run_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if engine is not None and hasattr(engine, "destroy"):
        engine.destroy()
    # zeroshard's own exit hook tears the process groups down (also the default group).


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------


def _python_for(args, family: str) -> str:
    return args.ds_python if family == "deepspeed" else args.python


def _env(args) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT),
                                                      env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS=str(args.threads), ZEROSHARD_QUIET="1", DS_ACCELERATOR="cpu",
               PYTHONUNBUFFERED="1")
    return env


def run_job(args, cluster_mod, variant: str, link: str, rnd: int, run_dir: Path) -> dict:
    """One variant on one link: a fresh cluster, one agent per host, torn down whatever happens."""
    family = ALL_VARIANTS[variant][0]
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("*"):
        old.unlink()
    logs = [run_dir / f"host{h}.log" for h in range(HOSTS)]
    worker_args = [str(Path(__file__).resolve()), "--worker", "--variant", variant,
                   "--link", link, "--round", str(rnd), "--run-dir", str(run_dir)]
    for key in ("steps", "warmup", "micro_batch", "seq_len", "width", "layers", "seed", "threads"):
        worker_args += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.wait_idle:
        wait_idle(args.wait_idle)
    busy0, mine0 = _busy_cpu_s(), _children_cpu_s()
    t0 = time.perf_counter()
    rc: list = [None] * HOSTS
    with cluster_mod.Cluster(hosts=HOSTS, rate=LINKS[link]) as cluster:
        argv = [_python_for(args, family), "-m", "zeroshard.cli", "run", "--nnodes", str(HOSTS),
                "--nproc-per-node", str(PER_HOST), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{cluster.addresses[0]}:{PORT}", "--rdzv-id", "zpp",
                "--no-alias-deepspeed", "--no-local-rank", *worker_args]
        procs = [cluster.start(h, argv, logs[h], env=_env(args)) for h in range(HOSTS)]
        deadline = time.monotonic() + args.timeout
        # Until both agents are done, one fails (its peer would wait in a collective for gloo's
        # timeout: stop it too) or the deadline passes; the cluster's close() kills the rest.
        while None in rc and not any(c not in (0, None) for c in rc):
            if time.monotonic() > deadline:
                rc = [c if c is not None else "timeout" for c in rc]
                break
            time.sleep(0.5)
            rc = [proc.poll() for proc in procs]
    wall = time.perf_counter() - t0
    foreign = max(0.0, (_busy_cpu_s() - busy0 - (_children_cpu_s() - mine0)) / wall)
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    job = {"variant": variant, "link": link, "round": rnd, "rc": rc, "wall_s": wall,
           "other_jobs_cores": foreign, "ranks": ranks}
    if len(ranks) != HOSTS * PER_HOST:
        job["error"] = _first_error(logs) or (
            f"timed out after {args.timeout:.0f} s" if "timeout" in rc else
            "no rank wrote its results")
        job["log_tail"] = "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                                    for p in logs if p.exists())
    return job


def _first_error(logs) -> str | None:
    """The first exception the workers raised, with the source line that raised it."""
    pattern = re.compile(r"^(?:\[rank\d+\]:\s*)?(\w+(?:Error|Exception)): (.*)")
    for path in logs:
        if not path.exists():
            continue
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            found = pattern.match(line.strip())
            if found:
                code = [re.sub(r"^\[rank\d+\]:", "", x).strip() for x in lines[max(0, i - 12):i]]
                where = next((x for x in reversed(code) if x and not set(x) <= set("^~ ")
                              and not x.startswith(("File ", "raise"))), "")
                return f"{found.group(1)}: {found.group(2)}" + (f" (at `{where}`)" if where
                                                                 else "")[:400]
    return None


def summarize_job(job: dict) -> dict | None:
    """Per job: slowest rank's median step, CPU s/step, wire and ledger bytes per step, losses."""
    ranks = job["ranks"]
    if job.get("error"):
        return None
    steps = len(ranks[0]["step_times_s"])
    hosts = {r["node"]: r["link_sent"] for r in ranks if r["local_rank"] == 0}
    ledgers = [r["ledger"] for r in ranks if r["ledger"]]
    out = {"step_s": max(r["median_step_s"] for r in ranks),
           "cpu_s": max(r["median_cpu_s"] for r in ranks),
           "wire_bytes": sum(hosts.values()) / steps,
           "loss": [r["final_loss"] for r in sorted(ranks, key=lambda r: r["rank"])],
           "psi": ranks[0]["psi"], "other_jobs_cores": job["other_jobs_cores"]}
    if len(ledgers) == len(ranks):
        for key in ("inter_host", "intra_host", "total"):
            out[f"ledger_{key}"] = sum(led[key] for led in ledgers) / steps
    return out


def _agg(jobs: list[dict]) -> dict:
    """Median over rounds of every measured quantity of one (variant, link)."""
    rows = [s for s in (summarize_job(j) for j in jobs) if s]
    if not rows:
        return {"error": next((j.get("error") for j in jobs if j.get("error")), "no run")}
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]
           if isinstance(rows[0][k], (int, float)) and all(k in r for r in rows)}
    out.update(loss=rows[-1]["loss"], runs=len(rows), best_step_s=min(r["step_s"] for r in rows),
               other_jobs_cores=max(r["other_jobs_cores"] for r in rows))
    return out


def report(saved: dict) -> str:
    """The markdown tables (one per link), the targets and the failures."""
    a = saved["args"]
    jobs = saved["jobs"]
    variants, links = saved["variants"], saved["links"]
    rows = {(v, l): _agg([j for j in jobs if j["variant"] == v
                          and (j["link"] == l or v == COMPUTE)])
            for v in variants for l in links}
    psi = next((int(r["psi"]) for r in rows.values() if "psi" in r), None)
    mb = 1e6
    lines = [
        "# ZeRO++ on two simulated hosts", "",
        f"Demo GPT {a['layers']} x {a['width']} ({a['width'] // 64} heads), vocab 128, "
        f"Ψ = {psi or 0:,} parameters, fp32, AdamW(lr={LR:g}); {HOSTS} hosts x {PER_HOST} ranks "
        "(gloo, "
        f"{a['threads']} thread/rank, all on this machine's {os.cpu_count()} cores), micro batch "
        f"{a['micro_batch']} x {a['seq_len']} tokens per rank; {a['warmup']} warm-up + "
        f"{a['steps']} timed steps, {a['rounds']} round(s) interleaved; stage 3 with every "
        "parameter sharded and released after use, one block prefetched (same knobs for "
        f"DeepSpeed); wall {saved.get('wall_s', 0) / 60:.1f} min.", ""]
    for link in links:
        base, ds = rows.get((BASE, link), {}), rows.get((DS_BASE, link), {})
        lines += [f"## link: {link}" + (" (tc tbf on each host's uplink)" if LINKS[link] else ""),
                  "", "| variant | step ms | best ms | CPU ms/step | inter-host MB/step (wire) "
                  "| bytes vs s3 | step vs s3 | step vs DeepSpeed s3 "
                  "| ledger inter / intra MB/step "
                  "| final loss (rank 0) | loss vs s3 | runs | other jobs, cores |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        for v in variants:
            r = rows[(v, link)]
            if "error" in r:
                lines.append(f"| {v} | FAILED: {r['error']} | | | | | | | | | | 0 | |")
                continue

            def ratio(key, other):
                return f"{r[key] / other[key]:.2f}x" if other.get(key) else "—"

            led = (f"{r['ledger_inter_host'] / mb:.1f} / {r['ledger_intra_host'] / mb:.1f}"
                   if "ledger_inter_host" in r else "—")
            compute = v == COMPUTE
            drift = (f"{(r['loss'][0] - base['loss'][0]) / base['loss'][0]:+.2%}"
                     if base.get("loss") and not compute else "—")
            lines.append(
                f"| {v} | {r['step_s'] * 1e3:.0f} | {r['best_step_s'] * 1e3:.0f} | "
                f"{r['cpu_s'] * 1e3:.0f} | {r['wire_bytes'] / mb:.1f} | "
                f"{'—' if compute else ratio('wire_bytes', base)} | {ratio('step_s', base)} | "
                f"{ratio('step_s', ds)} | {led} | {r['loss'][0]:.4f} | {drift} | {r['runs']} | "
                f"{r['other_jobs_cores']:.2f} |")
        lines.append("")
    lines += [
        "step ms: per job the slowest rank's median over the timed steps (each step starts after "
        "a barrier), median over rounds (best: minimum over rounds). CPU ms: the process's CPU "
        "time per step, same medians. inter-host MB/step: what the two hosts' uplinks sent "
        "(/proc/net/dev tx_bytes of each namespace's veth, every header included) between the "
        "barrier after the warm-up and the one after the last timed step, both hosts added, over "
        "the timed steps (the per-step barriers are in it: a few hundred bytes). ledger: "
        "zeroshard's `comm_report()` over the same steps, inter-host / intra-host bytes of all "
        "four ranks (ring model). loss vs s3: rank 0's final loss against plain zeroshard "
        "stage 3's (same data and initial weights; quantization shows here). compute-only: "
        "every rank runs the same step on its own whole model (no ZeRO, no collective in the "
        "step; its loss is of its own batch alone) while the other three do too: the step's "
        "arithmetic on these shared cores, without communication. other jobs, cores: the "
        "machine's busy CPU time during the job minus the job's own, over its wall time (max "
        "over rounds; 0 on an idle machine).", ""]
    lines += _targets(rows, links)
    fails = [j for j in jobs if j.get("error")]
    for j in fails:
        lines += ["", f"### {j['variant']} on {j['link']} failed (round {j['round']})", "",
                  f"agents exited {j['rc']}: {j['error']}"]
    return "\n".join(lines) + "\n"


def _targets(rows: dict, links: list[str]) -> list[str]:
    """Issue 18's targets on the limited link, and the compute-only time beside plain stage 3."""
    out = ["## Targets (limited link, all three components vs plain stage 3 / DeepSpeed stage 3)",
           ""]
    link = "1gbit" if "1gbit" in links else links[0]
    z, base, ds = (rows.get((v, link), {}) for v in (ALL3, BASE, DS_BASE))
    comp = rows.get((COMPUTE, link), {})
    if base.get("step_s") and comp.get("step_s"):
        out.append(f"- plain stage 3 on {link}: {base['step_s'] * 1e3:.0f} ms/step vs compute-only "
                   f"{comp['step_s'] * 1e3:.0f} ms ({base['step_s'] / comp['step_s']:.1f}x): "
                   + ("communication-bound" if base["step_s"] > 1.5 * comp["step_s"] else
                      "NOT clearly communication-bound"))
    checks = [("inter-host bytes", "wire_bytes", base, TARGETS["bytes"], "plain s3"),
              ("step time", "step_s", base, TARGETS["step"], "plain s3"),
              ("step time", "step_s", ds, TARGETS["step_vs_ds"], "DeepSpeed s3")]
    for what, key, other, bound, name in checks:
        if z.get(key) is None or other.get(key) is None:
            out.append(f"- {ALL3} {what} <= {bound} x {name}: not measured")
            continue
        ratio = z[key] / other[key]
        out.append(f"- {ALL3} {what} <= {bound} x {name}: {ratio:.2f}x "
                   f"{'PASS' if ratio <= bound else 'FAIL'}")
    return out


def prepare_deepspeed(args) -> None:
    """Build DeepSpeed's CPU communication op (JIT, cached in ~/.cache/torch_extensions) before
    the first job: a build cut short by a job's timeout leaves a lock that hangs every later job."""
    t0 = time.perf_counter()
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        done = subprocess.run([args.ds_python, "-c", code], env=_env(args), capture_output=True,
                              text=True, timeout=1200)
    except subprocess.TimeoutExpired:
        sys.exit("bench_zeropp: building DeepSpeed's CPU comm op took over 20 min; remove the "
                 "'lock' file under ~/.cache/torch_extensions/*/deepspeed_shm_comm and retry")
    if done.returncode:
        print(f"DeepSpeed's CPU comm op did not build ({done.stderr.strip()[-500:]}); its rows "
              "will show the error", flush=True)
    else:
        print(f"DeepSpeed's CPU comm op ready ({time.perf_counter() - t0:.0f} s)", flush=True)


def driver(args) -> None:
    """Every (link, variant) job, rounds interleaved; tables to stdout and --out."""
    sys.path.insert(0, str(ROOT))
    from tests import cluster as simulated

    variants = [v for v in args.variants.split(",") if v]
    links = [l for l in args.links.split(",") if l]
    bad = [v for v in variants if v not in ALL_VARIANTS] + [l for l in links if l not in LINKS]
    if bad:
        sys.exit(f"unknown variant(s)/link(s) {bad}: variants {list(ALL_VARIANTS)}, links "
                 f"{list(LINKS)}")
    reason = simulated.unavailable(rate_limited=any(LINKS[l] for l in links))
    if reason:
        sys.exit(f"bench_zeropp: {reason}")
    left = simulated.remove_leftovers()
    if left:
        print(f"removed namespaces left by an earlier run: {left}", flush=True)
    if any(ALL_VARIANTS[v][0] == "deepspeed" for v in variants):
        prepare_deepspeed(args)
    out = Path(args.out)
    saved = {"args": vars(args), "variants": variants, "links": links, "jobs": []}
    t0 = time.perf_counter()
    try:
        for rnd in range(1, args.rounds + 1):
            # compute-only communicates nothing in its steps: one job per round, on the first link
            order = [(v, l) for l in links for v in variants if v != COMPUTE or l == links[0]]
            if rnd > 1:
                random.Random(args.seed + rnd).shuffle(order)
            for variant, link in order:
                job = run_job(args, simulated, variant, link, rnd,
                              out / "runs" / "zeropp" / f"round{rnd}-{link}-{variant}")
                saved["jobs"].append(job)
                s = summarize_job(job)
                if s:
                    print(f"round {rnd} {link:9s} {variant:18s} step {s['step_s'] * 1e3:6.0f} ms"
                          f"  cpu {s['cpu_s'] * 1e3:6.0f} ms  inter-host "
                          f"{s['wire_bytes'] / 1e6:7.1f}"
                          f" MB/step  loss {s['loss'][0]:.4f}  ({job['wall_s']:.0f} s, other jobs "
                          f"{job['other_jobs_cores']:.2f} cores)", flush=True)
                else:
                    print(f"round {rnd} {link:9s} {variant:18s} FAILED ({job['wall_s']:.0f} s): "
                          f"{job['error']}\n{job['log_tail'][-2500:]}", flush=True)
    finally:
        saved["wall_s"] = time.perf_counter() - t0
        out.mkdir(parents=True, exist_ok=True)
        (out / "zeropp.json").write_text(json.dumps(saved, indent=1))
        left = simulated.remove_leftovers()
        if left:
            print(f"removed leftover namespaces {left}", flush=True)
    table = report(saved)
    (out / "zeropp.md").write_text(table)
    print("\n" + table)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds every Cluster: namespaces deleted


def parse_args(argv=None):
    """The driver's and the worker's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, default {','.join(VARIANTS)}; extra: "
                        f"{','.join(EXTRA_VARIANTS)}")
    p.add_argument("--links", default=",".join(LINKS), help="comma-separated: unlimited,1gbit")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--width", type=int, default=384, help="d_model (heads = width / 64)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds per job before both "
                   "hosts are killed and the job counts as failed")
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each job, wait up to this long until other processes use < 0.5 "
                        "core")
    p.add_argument("--python", default=sys.executable, help="Python of the zeroshard jobs")
    default_ds = sys.executable
    if not _has_module(sys.executable, "deepspeed") and Path("/work/ds-venv/bin/python").exists():
        default_ds = "/work/ds-venv/bin/python"
    p.add_argument("--ds-python", default=default_ds, help="Python with deepspeed installed")
    p.add_argument("--out", default=str(BENCH_DIR / "results"))
    p.add_argument("--summarize", metavar="ZEROPP_JSON",
                   help="only print the tables of a saved run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=list(ALL_VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--link", default="unlimited", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _has_module(python: str, name: str) -> bool:
    import importlib.util

    if python == sys.executable:
        return importlib.util.find_spec(name) is not None
    return subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode == 0


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    elif a.summarize:
        print(report(json.loads(Path(a.summarize).read_text())))
    else:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
        driver(a)
