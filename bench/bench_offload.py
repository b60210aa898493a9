"""NVMe offload (ZeRO-Infinity) benchmarks for zeroshard, one rank, each measurement in a fresh process.

nvme-step   NVMe-tier optimizer step vs the disk's own bandwidth, measured in the same run.
            Disk: a dd-style O_DIRECT sequential write (preallocated file, fsync), a read, then a
            read of that file while writing a second one (as the pipelined step does), 2 GiB each
            in 8 MiB aligned blocks, one thread per stream; also with 8 threads x 1 MiB
            (zeroshard's aio pattern); all before and again after the steps (the disk drifts).
            Step: a stack of nn.Linear(2048, 2048), fp32, stage 2, AdamW, offload_optimizer nvme
            (pipeline_read/write). engine.step() is timed apart from
            forward+backward; each step reads and writes master + exp_avg + exp_avg_sq, 24 B/param.
            Reported: median step time (first step skipped: it creates the state), disk GB/s the
            step achieved (24 Psi / step), and efficiency = (12 Psi/read_bw + 12 Psi/write_bw) / step.
infinity    GPT-2-style model (transformers GPT2LMHeadModel from a local GPT2Config, vocab 256), bf16,
            stage 3, optimizer and parameters on NVMe, micro batch 1, one fixed batch repeated.
            Reported: Psi, model states (16 B/param), memory_report(), peak RSS (ru_maxrss before
            destroy()), model states / peak RSS, median step time, losses.
Peak RSS is the child's ru_maxrss (MiB). Results: bench/results/offload.md and offload.json (each
subcommand updates its own entry). Swap files go under --nvme-path (deleted at the end).

Reproduce (about 3 minutes on 2 cores, ~3 GB RAM, ~6 GB free disk under --nvme-path):
    python bench/bench_offload.py all            # or: nvme-step / infinity, --size small for a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = {"nvme-step": {"small": dict(layers=8, disk_gib=0.5), "full": dict(layers=40, disk_gib=2.0)},
         "infinity": {"small": dict(n_layer=4, n_embd=512), "full": dict(n_layer=32, n_embd=1024)}}
MIB = 1 << 20


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's current resident set size, MiB."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def io_bytes() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process has caused at the storage layer (O_DIRECT included)."""
    with open("/proc/self/io") as fh:
        fields = dict(line.split(": ") for line in fh.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def aligned(nbytes: int):
    """A 4 KiB-aligned uint8 torch tensor of nbytes (filled with non-zero bytes)."""
    import torch
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start:start + nbytes].fill_(0x5A)


def disk_bandwidth(path: str, nbytes: int, block: int, threads: int) -> dict:
    """O_DIRECT sequential write (+fsync), read, then read-while-writing of nbytes in `block` chunks."""
    from concurrent.futures import ThreadPoolExecutor
    names = [os.path.join(path, f"disk-{threads}t-{k}.bin") for k in "ab"]
    fds = [os.open(n, os.O_CREAT | os.O_RDWR | os.O_TRUNC | os.O_DIRECT, 0o600) for n in names]
    pread = lambda f, b, o: os.preadv(f, [b], o)  # noqa: E731
    try:
        for fd in fds:
            os.posix_fallocate(fd, 0, nbytes)  # as zeroshard's swap files are
        bufs = [memoryview(aligned(block).numpy()) for _ in range(2 * threads)]
        offsets = range(0, nbytes, block)

        def run(op, fd, t):
            """Transfer every threads-th block of fd starting at block t, with buffer t."""
            for off in offsets[t % threads::threads]:
                op(fd, bufs[t], off)

        def timed(*jobs):
            """Seconds to run every (op, fd) job over the whole file, all jobs at once."""
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads * len(jobs)) as pool:
                list(pool.map(lambda t: run(*jobs[t // threads], t), range(threads * len(jobs))))
            for op, fd in jobs:
                if op is os.pwrite:
                    os.fsync(fd)
            return time.perf_counter() - t0

        write_s = timed((os.pwrite, fds[0]))
        read_s = timed((pread, fds[0]))
        mixed_s = timed((pread, fds[0]), (os.pwrite, fds[1]))
    finally:
        for fd, name in zip(fds, names):
            os.close(fd)
            os.remove(name)
    return dict(threads=threads, block=block, nbytes=nbytes, write_s=write_s, read_s=read_s,
                mixed_s=mixed_s, write_gbs=nbytes / write_s / 1e9, read_gbs=nbytes / read_s / 1e9,
                mixed_gbs=2 * nbytes / mixed_s / 1e9)


def nvme_config(path: str, stage: int, bf16: bool, params: bool) -> dict:
    """A DeepSpeed-style config: optimizer (and at stage 3 optionally params) on NVMe at path."""
    zero = {"stage": stage,
            "offload_optimizer": {"device": "nvme", "nvme_path": path, "pipeline_read": True,
                                  "pipeline_write": True, "buffer_count": 4}}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                    stage3_max_live_parameters=1e8, stage3_max_reuse_distance=0)
        if params:
            zero["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_count": 4}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": bf16}, "zero_optimization": zero,
            "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1}}


def nvme_step(args) -> dict:
    """Measurement 1: disk bandwidth, then the NVMe-tier optimizer step on a Linear stack."""
    import torch
    import zeroshard
    size = SIZES["nvme-step"][args.size]
    nbytes = int(size["disk_gib"] * (1 << 30))
    disk = [dict(disk_bandwidth(args.nvme_path, nbytes, 8 * MIB, 1), when="before"),
            dict(disk_bandwidth(args.nvme_path, nbytes, MIB, 8), when="before")]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(size["layers"])])
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    engine, *_ = zeroshard.initialize(model=model, optimizer=opt,
                                      config=nvme_config(args.nvme_path, 2, False, False))
    placement = engine.optimizer.placement
    x = torch.randn(8, 2048)
    fb, step, io = [], [], []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        t1, io0 = time.perf_counter(), io_bytes()
        engine.step()
        t2, io1 = time.perf_counter(), io_bytes()
        fb.append(t1 - t0)
        step.append(t2 - t1)
        io.append([b - a for a, b in zip(io0, io1)])
    report = engine.memory_report()
    disk += [dict(disk_bandwidth(args.nvme_path, nbytes, 8 * MIB, 1), when="after"),
             dict(disk_bandwidth(args.nvme_path, nbytes, MIB, 8), when="after")]
    out = dict(psi=psi, layers=size["layers"], disk=disk, fwd_bwd_s=fb, step_s=step, step_io=io,
               units=len(engine.optimizer.units), o_direct=placement.swap.direct,
               pool_buffers=placement.pool.count, pool_buffer_bytes=placement.pool.nbytes,
               memory_report=report, peak_rss_mib=peak_rss_mib(), loss=float(loss))
    engine.destroy()
    return out


def build_gpt2(n_layer: int, n_embd: int, seq: int):
    """transformers GPT2LMHeadModel from a local config (vocab 256, no dropout), fp32."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_embd // 64, n_positions=seq,
                     vocab_size=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def infinity(args) -> dict:
    """Measurement 2: GPT-2-style training with optimizer and parameters on NVMe (stage 3, bf16)."""
    import torch
    import zeroshard
    import transformers  # noqa: F401  (imported before the "start" RSS reading)
    size = SIZES["infinity"][args.size]
    rss0 = rss_mib()
    model = build_gpt2(size["n_layer"], size["n_embd"], args.seq)
    psi = sum(p.numel() for p in model.parameters())  # the tied embedding/head counted once
    rss_built, peak_built = rss_mib(), peak_rss_mib()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    engine, *_ = zeroshard.initialize(model=model, optimizer=opt,
                                      config=nvme_config(args.nvme_path, 3, True, True))
    init_s = time.perf_counter() - t0
    rss_init, peak_init = rss_mib(), peak_rss_mib()
    ids = torch.randint(0, 256, (1, args.seq), generator=torch.Generator().manual_seed(0))
    losses, fb, step, io = [], [], [], []
    for _ in range(args.steps):
        t0, io0 = time.perf_counter(), io_bytes()
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        t1, io1 = time.perf_counter(), io_bytes()
        engine.step()
        t2, io2 = time.perf_counter(), io_bytes()
        losses.append(float(loss))
        fb.append(t1 - t0)
        step.append(t2 - t1)
        io.append([b - a for a, b in zip(io0, io1)] + [b - a for a, b in zip(io1, io2)])
    report = engine.memory_report()
    peak_train, rss_train = peak_rss_mib(), rss_mib()
    swap_dir = os.path.join(args.nvme_path, "zeroshard", "rank0")
    on_disk = sum(os.path.getsize(os.path.join(swap_dir, f)) for f in os.listdir(swap_dir))
    engine.destroy()
    return dict(psi=psi, n_layer=size["n_layer"], n_embd=size["n_embd"], seq=args.seq,
                units=len(engine.optimizer.units), model_state_bytes=16 * psi,
                memory_report=report, swap_files_bytes=on_disk, init_s=init_s,
                rss_mib=dict(start=rss0, built=rss_built, initialized=rss_init, trained=rss_train),
                peak_rss_mib=dict(built=peak_built, initialized=peak_init, trained=peak_train,
                                  after_destroy=peak_rss_mib()),
                losses=losses, fwd_bwd_s=fb, step_s=step, io=io,
                total_s=[a + b for a, b in zip(fb, step)])


def fmt_bytes(n: float) -> str:
    """Bytes as GiB/MiB text."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


def report_nvme_step(r: dict) -> str:
    """Markdown for the nvme-step result."""
    psi, step = r["psi"], statistics.median(r["step_s"][1:])
    lines = [f"## NVMe optimizer step vs disk bandwidth ({r['layers']} x Linear(2048, 2048), "
             f"Psi = {psi:,}, fp32, stage 2, {r['units']} units, O_DIRECT={r['o_direct']})", "",
             "| disk test (O_DIRECT) | write GB/s | read GB/s | disk time 12 Psi read + 12 Psi "
             "write, one after the other | step efficiency | read+write at once GB/s | disk time, "
             "at once | step efficiency |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for d in r["disk"]:
        need = 12 * psi / (d["read_gbs"] * 1e9) + 12 * psi / (d["write_gbs"] * 1e9)
        mixed = 24 * psi / (d["mixed_gbs"] * 1e9)
        d.update(need_s=need, efficiency=need / step, mixed_need_s=mixed, mixed_efficiency=mixed / step)
        lines.append(f"| {d['when']} the steps, {d['threads']} thread(s) per stream x {d['block'] // MIB} MiB, "
                     f"{fmt_bytes(d['nbytes'])} | {d['write_gbs']:.2f} | {d['read_gbs']:.2f} | "
                     f"{need:.2f} s | {100 * need / step:.0f}% | {d['mixed_gbs']:.2f} | "
                     f"{mixed:.2f} s | {100 * mixed / step:.0f}% |")
    r["step_median_s"], r["achieved_gbs"] = step, 24 * psi / step / 1e9
    eff = [statistics.mean(d[k] for d in r["disk"]) for k in ("efficiency", "mixed_efficiency")]
    lines.append(f"| mean of the {len(r['disk'])} disk tests | | | | **{100 * eff[0]:.0f}%** | | "
                 f"| **{100 * eff[1]:.0f}%** |")
    r["efficiency_mean"], r["mixed_efficiency_mean"] = eff
    lines += ["", f"engine.step() median {step:.2f} s over {len(r['step_s']) - 1} steps "
              f"(first, state-creating step {r['step_s'][0]:.2f} s; all: "
              + ", ".join(f"{s:.2f}" for s in r["step_s"]) + f"); forward+backward median "
              f"{statistics.median(r['fwd_bwd_s']):.2f} s. Achieved {r['achieved_gbs']:.2f} GB/s "
              f"(24 B/param = {fmt_bytes(24 * psi)} per step; /proc/self/io per step after the "
              f"first: read {fmt_bytes(statistics.median(i[0] for i in r['step_io'][1:]))}, written "
              f"{fmt_bytes(statistics.median(i[1] for i in r['step_io'][1:]))}). Staging pool {r['pool_buffers']} x "
              f"{fmt_bytes(r['pool_buffer_bytes'])}. Peak RSS {r['peak_rss_mib']:.0f} MiB.",
              "Efficiency = disk-alone time for the same read+write volume / step time (target >= "
              "70%); 'at once' reads one file while writing another, as the pipelined step does.",
              ""]
    return "\n".join(lines)


def report_infinity(r: dict) -> str:
    """Markdown for the infinity result."""
    psi, peak = r["psi"], r["peak_rss_mib"]["trained"]
    ratio = r["model_state_bytes"] / (peak * MIB)
    r["ratio_model_states_to_peak_rss"] = ratio
    lines = [f"## ZeRO-Infinity: GPT2LMHeadModel(n_layer={r['n_layer']}, n_embd={r['n_embd']}, "
             f"vocab 256), seq {r['seq']}, micro batch 1, bf16, stage 3, optimizer + params on NVMe",
             "", "| Psi | model states (16 B/param) | peak RSS | model states / peak RSS | "
             "step time (median) | losses |", "|---:|---:|---:|---:|---:|---|",
             f"| {psi:,} | {fmt_bytes(r['model_state_bytes'])} | {peak:.0f} MiB | {ratio:.2f}x | "
             f"{statistics.median(r['total_s']):.2f} s (step {statistics.median(r['step_s']):.2f} s)"
             f" | {', '.join(f'{x:.3f}' for x in r['losses'])} |", "",
             "| memory_report | device | cpu | nvme |", "|---|---:|---:|---:|"]
    for kind, where in r["memory_report"].items():
        lines.append(f"| {kind} | " + " | ".join(fmt_bytes(where[p]) for p in
                                                 ("device", "cpu", "nvme")) + " |")
    rs, pk = r["rss_mib"], r["peak_rss_mib"]
    lines += ["", "RSS / peak RSS (MiB) at start " f"{rs['start']:.0f}, after build "
              f"{rs['built']:.0f} / {pk['built']:.0f}, after initialize {rs['initialized']:.0f} / "
              f"{pk['initialized']:.0f}, after training {rs['trained']:.0f} / {pk['trained']:.0f}, "
              f"after destroy() (which gathers every unit) peak {pk['after_destroy']:.0f}. "
              f"{r['units']} units; initialize {r['init_s']:.1f} s; swap files "
              f"{fmt_bytes(r['swap_files_bytes'])}. Per step fwd+bwd / step (s): "
              + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(r["fwd_bwd_s"], r["step_s"]))
              + ". Disk I/O per step (/proc/self/io, last step): fwd+bwd read "
              f"{fmt_bytes(r['io'][-1][0])} / wrote {fmt_bytes(r['io'][-1][1])}, step read "
              f"{fmt_bytes(r['io'][-1][2])} / wrote {fmt_bytes(r['io'][-1][3])}.", ""]
    return "\n".join(lines)


def run_child(name: str, args) -> dict:
    """Run one measurement in a fresh interpreter; return its JSON result."""
    os.makedirs(args.nvme_path, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), name, "--child", "--size", args.size,
           "--nvme-path", args.nvme_path, "--steps", str(args.steps), "--seq", str(args.seq),
           "--lr", str(args.lr)]
    env = dict(os.environ, ZEROSHARD_QUIET="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{name} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    """Parse options; run measurements in children (or, with --child, do one here)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("nvme-step", "infinity", "all"))
    ap.add_argument("--size", choices=("small", "full"), default="full")
    ap.add_argument("--nvme-path", default="/work/nvme_bench", help="swap directory (local disk)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (nvme-step: +1 skipped)")
    ap.add_argument("--seq", type=int, default=64, help="infinity: sequence length")
    ap.add_argument("--lr", type=float, default=3e-5, help="infinity: AdamW learning rate")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.nvme_path = os.path.abspath(args.nvme_path)
    if args.child:
        print(json.dumps((nvme_step if args.what == "nvme-step" else infinity)(args)))
        return
    names = ("nvme-step", "infinity") if args.what == "all" else (args.what,)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "offload.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    existed = os.path.exists(args.nvme_path)
    try:
        for name in names:
            t0 = time.perf_counter()
            results[name] = run_child(name, args)
            results[name].update(size=args.size, wall_s=time.perf_counter() - t0,
                                 command=" ".join(["python bench/bench_offload.py"] + sys.argv[1:]))
    finally:
        if not existed:
            shutil.rmtree(args.nvme_path, ignore_errors=True)
    import torch
    md = [f"# NVMe offload (zeroshard, 1 rank, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f})", ""]
    for name, fn in (("nvme-step", report_nvme_step), ("infinity", report_infinity)):
        if name in results:
            md += [fn(results[name]), f"`{results[name]['command']}` ({results[name]['size']}, "
                   f"{results[name]['wall_s']:.0f} s)", ""]
    text = "\n".join(md)
    print(text)
    with open(os.path.join(args.out, "offload.md"), "w") as fh:
        fh.write(text)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
