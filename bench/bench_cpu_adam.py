"""CPU AdamW throughput on one flat fp32 shard: torch fused / foreach vs DeepSpeedCPUAdam.

For each shard size (default 50 M, 100 M, 200 M fp32 elements):
  torch-fused         torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
  torch-foreach       the same with foreach=True
  deepspeed-cpu-adam  deepspeed.ops.adam.DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01,
                      adamw_mode=True)
Each gets its own param and grad (random normal) and two untimed warm-up steps (state allocated
and first-touched); then --rounds rounds, each timing --steps steps of every entry in turn
(round-robin, rotated each round, so drift hits all alike). Reported: the median step time over
all timed steps, params/s = numel / median step time, the ratio to deepspeed-cpu-adam.

Memory bandwidth (torch, fp32, --threads threads), measured twice:
  * once up front on 3 tensors of --bw-n elements: triad torch.add(b, c, alpha=s, out=a), counted
    as 2 reads + 1 write = 12 B/element (the write-allocate read of `a`, which the hardware does
    too, is not counted), copy a.copy_(b) = 8 B/element, and an in-place a.add_(b, alpha=s)
    (2 reads + 1 write back to a line just read: no write-allocate, 12 B/element);
  * triad and in-place again at every shard size, on n-element tensors, interleaved with the
    optimizers in the same rounds (this machine's bandwidth drifts by up to 2x over minutes).
AdamW moves at least 28 B/param/step (reads param, grad, exp_avg, exp_avg_sq = 16 B; writes
param, exp_avg, exp_avg_sq = 12 B), so the bound is GB/s / 28 params/s. "of triad bound" uses the
interleaved triad; "of in-place bound" the interleaved in-place add, whose access pattern (every
write goes to a line just read) is Adam's. A parity check runs 3 steps of torch-fused and
deepspeed-cpu-adam on the same 1 M-element tensor and compares both with an fp64 torch reference.

DeepSpeedCPUAdam needs its C++ op `cpu_adam`: with DS_ACCELERATOR=cpu (set here) DeepSpeed
JIT-builds it on first use with ninja + g++ (-O3 -march=native -fopenmp; ~45 s on the 2-core
machine) into ~/.cache/torch_extensions/<py>_cpu/cpu_adam/ and loads it from there afterwards.
No CUDA, oneCCL or pre-built wheel is needed. If the build fails, the column is "unavailable".
OMP_NUM_THREADS is set to --threads before torch/deepspeed are imported (the op's OpenMP loops
use torch's libgomp).

Reproduce (~2 minutes, ~14 GB RAM at 200 M; on an otherwise idle machine):
    python bench/bench_cpu_adam.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

IMPLS = ("torch-fused", "torch-foreach", "deepspeed-cpu-adam")
PROBES = {"triad": 12, "in-place": 12, "copy": 8}  # bytes counted per element
LR, WD, BYTES_PER_PARAM = 1e-3, 0.01, 28
torch = None  # imported in main() after OMP_NUM_THREADS is set


def parse_args(argv=None):
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="50e6,100e6,200e6", help="comma-separated shard sizes")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch/OpenMP threads")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of the three")
    ap.add_argument("--bw-n", type=float, default=200e6, help="elements per up-front bandwidth tensor")
    ap.add_argument("--bw-repeats", type=int, default=10, help="up-front bandwidth repeats (median)")
    ap.add_argument("--check-n", type=float, default=1e6, help="parity-check size (0: skip)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return ap.parse_args(argv)


def load_deepspeed():
    """Import DeepSpeedCPUAdam and build/load its op; returns (class or None, info dict)."""
    t0 = time.perf_counter()
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
        builder = CPUAdamBuilder()
        if not builder.is_compatible(verbose=True):
            raise RuntimeError("CPUAdamBuilder reports the op as incompatible with this system")
        print("loading DeepSpeed cpu_adam op (JIT-built with ninja on first use: minutes)...", flush=True)
        builder.load(verbose=False)
        info = {"available": True, "load_s": round(time.perf_counter() - t0, 1)}
        print(f"  cpu_adam ready after {info['load_s']} s", flush=True)
        return DeepSpeedCPUAdam, info
    except Exception as exc:  # a failed build must not stop the torch columns
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        reason = reason if len(reason) < 400 else reason[:150] + " ... " + reason[-250:]
        print(f"  DeepSpeedCPUAdam unavailable: {reason}", flush=True)
        return None, {"available": False, "reason": reason}


def make_optimizer(impl, p, ds_cls):
    """The optimizer under test for one parameter."""
    if impl == "torch-fused":
        return torch.optim.AdamW([p], lr=LR, weight_decay=WD, fused=True)
    if impl == "torch-foreach":
        return torch.optim.AdamW([p], lr=LR, weight_decay=WD, foreach=True)
    return ds_cls([p], lr=LR, weight_decay=WD, adamw_mode=True)


def probes(n, names):
    """Bandwidth kernels on three fresh n-element fp32 tensors: name -> callable."""
    a, b, c = (torch.randn(n) for _ in range(3))
    fns = {"triad": lambda: torch.add(b, c, alpha=3.0, out=a), "in-place": lambda: a.add_(b, alpha=1e-3)}
    return {k: fns.get(k, lambda: a.copy_(b)) for k in names}


def bandwidth(n, repeats):
    """Up-front median bandwidth (GB/s, 1e9 B/s) of each probe on n-element tensors."""
    out = {"n": n, "repeats": repeats}
    for name, fn in probes(n, PROBES).items():
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name + "_GBps"] = PROBES[name] * n / statistics.median(times) / 1e9
    return out


def bench_size(n, impls, ds_cls, args):
    """Round-robin timing of every implementation and the triad/in-place probes at size n."""
    gen = torch.Generator().manual_seed(0)
    p0, g0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    fns = {}
    for impl in impls:
        p = torch.nn.Parameter(p0.clone())
        p.grad = g0.clone()
        fns[impl] = make_optimizer(impl, p, ds_cls).step
        for _ in range(args.warmup):
            fns[impl]()
    del p0, g0
    fns.update(probes(n, ("triad", "in-place")))
    names = list(fns)
    times = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)
        print(f"  n={n:,} round {r + 1}: " + ", ".join(
            f"{k} {1e3 * statistics.median(times[k][-args.steps:]):.0f} ms" for k in names), flush=True)
    return times


def parity(n, ds_cls, steps=3):
    """torch-fused vs deepspeed-cpu-adam params after `steps` steps, both vs an fp64 torch reference."""
    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(steps)]
    res = {}
    for impl, dtype in (("torch-fused", torch.float32), ("deepspeed-cpu-adam", torch.float32),
                        ("fp64", torch.float64)):
        p = torch.nn.Parameter(p0.to(dtype, copy=True))
        opt = (torch.optim.AdamW([p], lr=LR, weight_decay=WD, foreach=False) if impl == "fp64"
               else make_optimizer(impl, p, ds_cls))
        for g in grads:
            p.grad = g.to(dtype, copy=True)
            opt.step()
        res[impl] = p.detach().double()
    a, b, ref = res["torch-fused"], res["deepspeed-cpu-adam"], res["fp64"]
    return {"n": n, "steps": steps, "max_abs_diff": (a - b).abs().max().item(),
            "max_rel_diff": ((a - b).abs() / b.abs()).max().item(),
            "max_abs_update": (ref - p0.double()).abs().max().item(),
            "fused_vs_fp64_abs": (a - ref).abs().max().item(), "ds_vs_fp64_abs": (b - ref).abs().max().item(),
            "fused_vs_fp64_rel": ((a - ref).abs() / ref.abs()).max().item(),
            "ds_vs_fp64_rel": ((b - ref).abs() / ref.abs()).max().item()}


def render(res):
    """Markdown report from the result dict."""
    bw, m = res["bandwidth"], res["meta"]
    lines = [f"# CPU AdamW throughput ({m['cpu']}, {m['threads']} threads)", "",
             f"torch {m['torch']}, deepspeed {m['deepspeed']}; {m['steps']} timed steps x {m['rounds']} "
             f"rounds (round-robin) after {m['warmup']} warm-up steps; median step time; 1-min load "
             f"average {m['load_1min'][0]:.1f} at start, {m['load_1min'][1]:.1f} at end; {m['wall_s']:.0f} s.", "",
             f"Up-front bandwidth (3 x {bw['n']:,} fp32, median of {bw['repeats']}): triad {bw['triad_GBps']:.1f}"
             f" GB/s (12 B/elem: 2 reads + 1 write), in-place a += s*b {bw['in-place_GBps']:.1f} GB/s (12 B/elem),"
             f" copy {bw['copy_GBps']:.1f} GB/s (8 B/elem). AdamW moves 28 B/param/step.", "",
             "| size | impl | step ms | M params/s | vs deepspeed-cpu-adam | of triad bound | of in-place bound |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for size, rows in res["results"].items():
        bounds = [rows[k]["GBps"] * 1e9 / BYTES_PER_PARAM for k in ("triad", "in-place")]
        ds = rows.get("deepspeed-cpu-adam", {}).get("params_per_s")
        for impl in (k for k in rows if k not in PROBES):
            pps = rows[impl].get("params_per_s")
            if pps is None:
                lines.append(f"| {size} | {impl} | unavailable | — | — | — | — |")
                continue
            ratio = f"{pps / ds:.2f}x" if ds else "—"
            lines.append(f"| {size} | {impl} | {1e3 * rows[impl]['median_step_s']:.1f} | {pps / 1e6:.0f} | "
                         f"{ratio} | {pps / bounds[0]:.0%} | {pps / bounds[1]:.0%} |")
        lines.append(f"| {size} | bound: triad {rows['triad']['GBps']:.1f} GB/s, in-place "
                     f"{rows['in-place']['GBps']:.1f} GB/s (interleaved) | — | {bounds[0] / 1e6:.0f} / "
                     f"{bounds[1] / 1e6:.0f} | — | 100% | 100% |")
    ds_info = res["deepspeed_op"]
    lines += ["", "deepspeed cpu_adam op: " + (f"loaded in {ds_info['load_s']} s (includes the JIT build "
              "if it was not cached)" if ds_info["available"] else f"unavailable ({ds_info['reason']})")]
    if res.get("parity"):
        pc = res["parity"]
        lines.append(f"Parity, torch-fused vs deepspeed-cpu-adam, {pc['n']:,} elements, {pc['steps']} steps: "
                     f"max |diff| {pc['max_abs_diff']:.2e} (max |update| {pc['max_abs_update']:.2e}), max "
                     f"elementwise relative diff {pc['max_rel_diff']:.2e}. Vs an fp64 torch AdamW reference, max "
                     f"abs / relative error: torch-fused {pc['fused_vs_fp64_abs']:.2e} / {pc['fused_vs_fp64_rel']:.2e}"
                     f", deepspeed-cpu-adam {pc['ds_vs_fp64_abs']:.2e} / {pc['ds_vs_fp64_rel']:.2e}.")
    return "\n".join(lines) + "\n"


def main(argv=None):
    """Run the bandwidth, throughput and parity measurements; print and write the report."""
    global torch
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch as _torch
    torch = _torch
    torch.set_num_threads(args.threads)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    ds_cls, ds_info = (load_deepspeed() if "deepspeed-cpu-adam" in impls
                       else (None, {"available": False, "reason": "not selected"}))
    import deepspeed
    live = [i for i in impls if i != "deepspeed-cpu-adam" or ds_cls is not None]
    t_start, load_start = time.time(), os.getloadavg()[0]
    print(f"bandwidth: 3 x {int(args.bw_n):,} fp32 elements...", flush=True)
    bw = bandwidth(int(args.bw_n), args.bw_repeats)
    print("  " + ", ".join(f"{k} {bw[k + '_GBps']:.1f} GB/s" for k in PROBES), flush=True)
    results, raw = {}, {}
    for size in (int(float(s)) for s in args.sizes.split(",")):
        key = f"{size / 1e6:g}M"
        raw[key] = times = bench_size(size, live, ds_cls, args)
        results[key] = {i: {"median_step_s": statistics.median(times[i]), "min_step_s": min(times[i]),
                            "params_per_s": size / statistics.median(times[i])} if i in times else
                        {"params_per_s": None} for i in impls}
        results[key].update({k: {"GBps": PROBES[k] * size / statistics.median(times[k]) / 1e9}
                             for k in ("triad", "in-place")})
    check = parity(int(args.check_n), ds_cls) if args.check_n and ds_cls is not None else None
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    res = {"meta": {"cpu": cpu, "threads": args.threads, "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "steps": args.steps, "warmup": args.warmup,
                    "rounds": args.rounds, "python": sys.version.split()[0], "argv": sys.argv[1:],
                    "wall_s": round(time.time() - t_start, 1), "load_1min": [load_start, os.getloadavg()[0]]},
           "bandwidth": bw, "deepspeed_op": ds_info, "results": results, "parity": check, "step_times_s": raw}
    text = render(res)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_adam.md"), "w") as fh, \
            open(os.path.join(args.out, "cpu_adam.json"), "w") as fj:
        fh.write(text), json.dump(res, fj, indent=1)


if __name__ == "__main__":
    main()
