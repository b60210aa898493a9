"""One prepared check for a machine with one CUDA GPU: does zeroshard work, overlap and fit there?

    python bench/gpu_check.py                      # all sections (each under its limit), gpu_check.json
    python bench/gpu_check.py --sections matrix    # one section
    python bench/gpu_check.py --sections throughput,generate  # side by side (gpu_throughput.py;
                                                     # not yet timed on a GPU)
    python bench/gpu_check.py --cpu                # the same code on the CPU over gloo: checks the script

Each section runs in its own process with its own time limit, so a crash, a hang or an out-of-memory
ends that section only; the report says which. Sections:

  matrix   world 1 on NCCL: stages 0-3 x fp32/bf16/fp16 x optimizer placement device / cpu /
           cpu pinned / nvme (stage 3: parameters placed alike). Per configuration: one step against
           a plain torch reference (fp32 model, same AdamW; `rel` = largest parameter difference over
           the largest update the reference made), save + load into a fresh engine (parameters equal,
           and the next step equal), the host syncs in one step (torch.cuda.set_sync_debug_mode
           "warn", counted with their call sites), and at stage 3 `memory_allocated` after every
           unit's release during one forward + backward.
  gloo2    two processes sharing the GPU over gloo with CUDA tensors (NCCL refuses two ranks on one
           GPU), stages 1-3, against the reference.
  streams  one step of stage 2, stage 3 and stage 3 + CPU offload under the profiler: which CUDA
           stream each memcpy, memset and communication kernel ran on.
  largest  the largest GPT (width 2048, 32k vocabulary, sequence 512) that trains a step at stage 3
           with optimizer and parameters offloaded to pinned CPU memory (bf16), against plain torch
           on the GPU (fp32 weights, bf16 autocast, AdamW): layers doubled, then bisected.
  throughput  side by side on one Llama-style model (RMSNorm, rotary attention, SwiGLU; about
           220 M parameters, sequence 1024, bf16 compute, AdamW), world 1: plain torch (fp32
           weights, bf16 autocast), FSDP2 (`fully_shard` per block, bf16 parameters, fp32
           reduction) with and without CPUOffloadPolicy, zeroshard stage 3 (bf16) with and
           without optimizer + parameter offload to pinned CPU memory. Per variant: tokens/s at
           the median step time, MFU (6 x parameters per token over the GPU's dense bf16 peak,
           zeroshard.monitor.throughput), peak memory_allocated, the last loss.
  generate greedy `generate()` of a Hugging Face Llama (about 220 M parameters, bf16; skipped
           without transformers) at batch 1, 32 and 128 new tokens: plain torch and a zeroshard
           stage-3 engine without an optimizer (the model gathered once per call) in turn, median
           of the paired time ratios, and whether both produced the same tokens.
The throughput and generate sections live in gpu_throughput.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("matrix", "gloo2", "streams", "largest", "throughput", "generate")
# Seconds per section (together under 8 minutes); tripled under --cpu, where the CPU does it all.
# Measured on an H200 (2026-11-30): matrix 38 s, gloo2 13 s, streams 8 s; one `largest` try
# 50-100 s (pinning and freeing tens of GB of host memory).
LIMITS = {"matrix": 120, "gloo2": 60, "streams": 40, "largest": 240, "throughput": 240,
          "generate": 120}
PRECISIONS = ("fp32", "bf16", "fp16")
PLACEMENTS = ("device", "cpu", "cpu_pinned", "nvme")
# `rel_mean` a configuration may reach: the mean distance of its fp32 master weights from the fp32
# reference's after one AdamW step, over the mean update (about lr = 1e-3 per weight). In fp32 it
# is summation order alone; in bf16/fp16 the gradients themselves are rounded.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.1, "fp16": 0.05}


# -- shared pieces -----------------------------------------------------------------------------

def device():
    """The compute device of this check: cuda:0, or the CPU under --cpu."""
    import torch

    return torch.device("cpu") if os.environ.get("GPU_CHECK_CPU") == "1" else torch.device("cuda", 0)


def small_gpt(seed: int = 0):
    """The demo's character GPT, a little wider: big enough for several stage-3 units."""
    import torch

    from zeroshard.cli.demo import GPTConfig, TinyGPT

    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(vocab_size=128, block_size=64, d_model=256, n_layer=4, n_head=4))


def batch(step: int, rank: int = 0, world: int = 1):
    """This rank's share of a fixed global batch of 8 sequences for `step`."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 128, (8, 65), generator=gen)
    per = 8 // world
    mine = tokens[rank * per:(rank + 1) * per]
    return mine[:, :-1].to(device()), mine[:, 1:].to(device())


def loss_of(logits, targets):
    """Mean token cross-entropy, in fp32."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def ds_config(stage: int, precision: str, placement: str, nvme_dir: str, world: int = 1) -> dict:
    """The DeepSpeed-format config of one matrix cell."""
    zero: dict = {"stage": stage, "reduce_bucket_size": 2e5}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    if placement != "device" and stage > 0:
        where = {"device": "nvme", "nvme_path": nvme_dir} if placement == "nvme" else \
            {"device": "cpu", "pin_memory": placement == "cpu_pinned"}
        zero["offload_optimizer"] = dict(where)
        if stage == 3:
            zero["offload_param"] = dict(where)
    return {"train_micro_batch_size_per_gpu": 8 // world, "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
            "bf16": {"enabled": precision == "bf16"}, "zero_optimization": zero}


def reference(steps: int = 2):
    """Plain torch, one process, fp32: parameters before and after each step."""
    import torch

    model = small_gpt().to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    snapshots = [{n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}]
    for step in range(steps):
        x, y = batch(step)
        loss_of(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        snapshots.append({n: p.detach().float().cpu().clone() for n, p in model.named_parameters()})
    return snapshots


def rel_error(state: dict, ref_before: dict, ref_after: dict) -> dict:
    """How far `state` (fp32 weights after one step) is from the reference's, in units of the
    update the reference made: the largest element and the mean."""
    import torch

    diff = torch.cat([(state[k].float().cpu() - ref_after[k]).abs().reshape(-1) for k in ref_after])
    update = torch.cat([(ref_after[k] - ref_before[k]).abs().reshape(-1) for k in ref_after])
    return {"rel_max": diff.max().item() / max(update.max().item(), 1e-12),
            "rel_mean": diff.mean().item() / max(update.mean().item(), 1e-12)}


def failure(err: BaseException) -> str:
    """`err` for the report: its type, message and the last frames it passed (file:line)."""
    frames = traceback.extract_tb(err.__traceback__)[-4:]
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(err).__name__}: {str(err)[:300]} [at {where}]"


def train_step(engine, step: int, rank: int = 0, world: int = 1) -> float:
    """Forward, backward and step on this rank's share of `step`'s batch; the loss."""
    x, y = batch(step, rank, world)
    loss = loss_of(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def sync_audit(fn) -> dict:
    """Run `fn` with CUDA's sync debug mode on: how many host syncs, and from where."""
    import torch

    if device().type != "cuda":
        fn()
        return {"syncs": None, "note": "no CUDA: not audited"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites: dict[str, int] = {}
    for w in syncs:
        site = f"{os.path.relpath(w.filename, HERE + '/..')}:{w.lineno}"
        sites[site] = sites.get(site, 0) + 1
    return {"syncs": len(syncs), "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8])}


def release_memory(engine) -> dict:
    """At stage 3: memory_allocated after each unit's release in one forward + backward."""
    import torch

    gatherer = getattr(engine.optimizer.policy, "params", None)  # stage 3's ParamGatherer
    if not hasattr(gatherer, "reshard") or device().type != "cuda":
        return {}
    seen = []
    original = gatherer.reshard

    def reshard(index, *args, **kwargs):
        result = original(index, *args, **kwargs)
        seen.append(torch.cuda.memory_allocated())
        return result

    gatherer.reshard = reshard
    try:
        x, y = batch(5)
        engine.backward(loss_of(engine(x), y))
        engine.zero_grad()
    finally:
        del gatherer.reshard
    report = engine.memory_report()
    return {"after_release_min": min(seen, default=None), "after_release_max": max(seen, default=None),
            "releases": len(seen), "shards_on_device": report["params"]["device"]}


def init_world(rank: int = 0, world: int = 1, backend: str | None = None) -> None:
    """A process group of `world` ranks on this machine (NCCL on the GPU, gloo under --cpu)."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", ZEROSHARD_QUIET="1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if device().type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend or ("nccl" if device().type == "cuda" else "gloo"),
                            rank=rank, world_size=world)


# -- sections ----------------------------------------------------------------------------------

def section_matrix(quick: bool) -> dict:
    """Every stage x precision x placement at world 1: step, save/load, syncs, stage-3 memory."""
    import torch

    import zeroshard
    from zeroshard.consolidate import consolidated_state_dict as from_checkpoint

    init_world()
    ref = reference()
    cells = []
    stages = (0, 1, 2, 3)
    precisions = ("fp32", "bf16") if quick else PRECISIONS
    for stage in stages:
        for precision in precisions:
            for placement in (("device",) if stage == 0 else PLACEMENTS):
                if quick and placement == "cpu":
                    continue
                cell = {"stage": stage, "precision": precision, "placement": placement}
                start = time.perf_counter()
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        cfg = ds_config(stage, precision, placement, os.path.join(tmp, "swap"))
                        engine, *_ = zeroshard.initialize(model=small_gpt(), config=cfg)
                        engine.optimizer.syncs.reset()
                        cell["audit"] = sync_audit(lambda: train_step(engine, 0))
                        # zeroshard's own counted host-sync points (dist/hostsync.py) in that step
                        cell["audit"]["counted"] = dict(engine.optimizer.syncs.counts)
                        engine.save_checkpoint(os.path.join(tmp, "ckpt"))
                        masters = from_checkpoint(os.path.join(tmp, "ckpt"))  # fp32
                        cell.update(rel_error(masters, ref[0], ref[1]))
                        cell["ok"] = cell["rel_mean"] <= TOLERANCE[precision]
                        cfg = ds_config(stage, precision, placement, os.path.join(tmp, "swap2"))
                        fresh, *_ = zeroshard.initialize(model=small_gpt(seed=9), config=cfg)
                        fresh.load_checkpoint(os.path.join(tmp, "ckpt"))
                        a = engine.consolidated_state_dict()
                        b = fresh.consolidated_state_dict()
                        cell["load_equal"] = all(torch.equal(a[k], b[k]) for k in a)
                        train_step(engine, 1)
                        train_step(fresh, 1)
                        a, b = engine.consolidated_state_dict(), fresh.consolidated_state_dict()
                        cell["resume_equal"] = all(torch.equal(a[k], b[k]) for k in a)
                        if stage == 3:
                            cell["stage3_memory"] = release_memory(engine)
                        cell["device_bytes"] = {k: v["device"] for k, v in
                                                engine.memory_report().items()}
                        engine.destroy()
                        fresh.destroy()
                except Exception as err:  # noqa: BLE001 - the report names it; the matrix goes on
                    cell["error"] = failure(err)
                    cell["ok"] = False
                cell["seconds"] = round(time.perf_counter() - start, 2)
                cells.append(cell)
                print(json.dumps(cell), flush=True)
    failed = [c for c in cells if not c.get("ok") or not c.get("load_equal", False)
              or not c.get("resume_equal", False)]
    return {"cells": cells, "failed": len(failed), "total": len(cells)}


def _gloo2_rank(rank: int, port: int, out: str) -> None:
    import torch

    import zeroshard

    os.environ["MASTER_PORT"] = str(port)
    init_world(rank, 2, backend="gloo")
    ref = reference()
    result = {}
    for stage in (1, 2, 3):
        try:
            engine, *_ = zeroshard.initialize(model=small_gpt(), config=ds_config(stage, "fp32",
                                                                                 "device", "", 2))
            train_step(engine, 0, rank, 2)
            state = engine.consolidated_state_dict(rank0_only=False)
            result[f"stage{stage}"] = {**rel_error(state, ref[0], ref[1]),
                                       "on": str(next(engine.module.parameters()).device)}
            engine.destroy()
        except Exception as err:  # noqa: BLE001
            result[f"stage{stage}"] = {"error": failure(err)}
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(result, fh)
    torch.distributed.destroy_process_group()


def section_gloo2(quick: bool) -> dict:
    """Two processes on one GPU over gloo with device tensors, stages 1-3, against the reference."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo2")
        mp.start_processes(_gloo2_rank, args=(29613, out), nprocs=2, start_method="spawn")
        ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    ok = all("error" not in c and c["rel_mean"] <= TOLERANCE["fp32"]
             for r in ranks for c in r.values())
    return {"ranks": ranks, "ok": ok}


def section_streams(quick: bool) -> dict:
    """Which CUDA stream each copy, memset and communication kernel of one step ran on."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zeroshard

    init_world()
    if device().type != "cuda":
        return {"note": "no CUDA: streams not profiled"}
    found = {}
    for name, stage, placement in (("stage2", 2, "device"), ("stage3", 3, "device"),
                                   ("stage3+cpu", 3, "cpu_pinned")):
        engine, *_ = zeroshard.initialize(model=small_gpt(), config=ds_config(stage, "bf16",
                                                                             placement, ""))
        train_step(engine, 0)  # warm up
        with tempfile.TemporaryDirectory() as tmp:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                train_step(engine, 1)
                torch.cuda.synchronize()
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            events = json.load(open(trace)).get("traceEvents", [])
        counts: dict[str, int] = {}
        for event in events:
            cat, label = event.get("cat", ""), event.get("name", "")
            stream = (event.get("args") or {}).get("stream")
            if stream is None or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
                continue
            kind = "nccl" if "nccl" in label.lower() else cat if cat != "kernel" else \
                ("copy/cast" if "copy" in label.lower() or "elementwise" in label.lower()
                 else "compute")
            key = f"{kind} @ stream {stream}"
            counts[key] = counts.get(key, 0) + 1
        found[name] = dict(sorted(counts.items()))
        engine.destroy()
    return found


def _largest_model(layers: int):
    """A pre-norm GPT whose weights are initialized inside the module constructors (as
    zeroshard.Init needs): embeddings, `layers` torch encoder layers with a causal mask, a head."""
    import torch
    from torch import nn

    d, vocab, seq = _largest_shape()

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(
                nn.TransformerEncoderLayer(d, d // 128, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True) for _ in range(layers))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
            h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
            for block in self.blocks:
                h = block(h, src_mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return Gpt()


def _largest_try(mode: str, layers: int) -> None:
    """Child of `largest`: one training step of a GPT with `layers` blocks, or an error."""
    import torch

    import zeroshard

    d, vocab, seq = _largest_shape()
    x = torch.randint(0, vocab, (1, seq), device=device())
    if mode == "plain":
        model = _largest_model(layers).to(device())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device().type == "cuda")
        with torch.autocast(device().type, dtype=torch.bfloat16):
            loss = loss_of(model(x), x)
        loss.backward()
        opt.step()
    else:
        init_world()
        pinned = {"device": "cpu", "pin_memory": device().type == "cuda"}
        cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "zero_optimization": {"stage": 3, "offload_optimizer": pinned,
                                     "offload_param": pinned}}
        with zeroshard.Init(config=cfg):
            model = _largest_model(layers)
        engine, *_ = zeroshard.initialize(model=model, config=cfg)
        engine.backward(loss_of(engine(x), x))
        engine.step()
    print(json.dumps({"ok": True, "peak_gib": torch.cuda.max_memory_allocated() / 2**30
                      if device().type == "cuda" else None}))


def _largest_shape() -> tuple[int, int, int]:
    """(width, vocabulary, sequence) of the `largest` GPT; tiny under --cpu (a script check)."""
    return (256, 1024, 64) if device().type == "cpu" else (2048, 32000, 512)


def _gpt_params(layers: int) -> int:
    d, vocab, seq = _largest_shape()
    return vocab * d + seq * d + layers * (12 * d * d + 13 * d) + 2 * d + d * vocab


def _partial(body: dict) -> None:
    """Write a section's results so far where its final result goes (read if it is cut off)."""
    path = os.environ.get("GPU_CHECK_RESULT")
    if path:
        with open(path, "w") as fh:
            json.dump(body, fh)


def section_largest(quick: bool) -> dict:
    """Largest GPT that trains one step: stage 3 + pinned CPU offload vs plain torch on the GPU.

    Each side searches in its own share of the time (doubling from a start, then bisecting); a
    try that outlasts what is left ends that side's search. On the first H200 run plain torch
    trained 128 layers (6.5 B parameters) and stage 3 + offload 64, so the GPU searches start
    there. What is found so far is written to the result file after every try: a section cut
    off at its limit still reports it."""
    out = {}
    total = limit("largest") - 10
    starts = {"plain": 128, "zeroshard": 64} if device().type == "cuda" else {"plain": 4,
                                                                               "zeroshard": 4}
    for mode, share in (("plain", 0.4), ("zeroshard", 0.6)):
        deadline = time.monotonic() + share * total
        good, bad, layers, tries = 0, None, starts[mode], []
        while time.monotonic() < deadline - 5:
            began = time.monotonic()
            try:
                proc = subprocess.run([sys.executable, __file__, "--child-largest", mode, str(layers)],
                                      capture_output=True, text=True,
                                      timeout=max(5, min(120, deadline - time.monotonic())))
                fits = proc.returncode == 0 and '"ok": true' in proc.stdout
                why = None if fits else (proc.stdout + proc.stderr).strip()[-300:]
            except subprocess.TimeoutExpired:
                fits, why = None, "out of time"  # too slow to tell: stop searching
            tries.append({"layers": layers, "fits": fits, "seconds": round(time.monotonic() - began, 1),
                          **({"why": why} if why else {})})
            if fits is None:
                break
            if fits:
                good = layers
            else:
                bad = layers
            out[mode] = {"layers": good, "first_failure_layers": bad, "tries": tries}
            _partial(out)
            if bad is None:
                layers *= 2
            elif bad - good <= max(1, good // 8):
                break
            elif good == 0:
                layers = max(1, bad // 2)
            else:
                layers = (good + bad) // 2
            if (quick or device().type == "cpu") and good >= 8:
                break
        out[mode] = {"layers": good, "params": _gpt_params(good) if good else 0,
                     "first_failure_layers": bad, "tries": tries}
    if out["plain"]["params"]:
        out["ratio"] = out["zeroshard"]["params"] / out["plain"]["params"]
    return out


# -- driver ------------------------------------------------------------------------------------

def _section(name: str):
    """The function of section `name`: here, or in gpu_throughput.py (the side-by-side ones)."""
    if f"section_{name}" in globals():
        return globals()[f"section_{name}"]
    import gpu_throughput

    return getattr(gpu_throughput, f"section_{name}")


def limit(name: str) -> int:
    """Seconds section `name` may take."""
    return LIMITS[name] * (3 if device().type == "cpu" else 1)


def run_section(name: str, quick: bool) -> dict:
    """Run one section in a child process under its time limit; its result or what went wrong."""
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", name, "--result", result.name]
                                  + (["--quick"] if quick else []),
                                  capture_output=True, text=True, timeout=limit(name),
                                  env={**os.environ, "GPU_CHECK_RESULT": result.name})
            text = open(result.name).read()
            body = json.loads(text) if text else {"error": "no result",
                                                   "tail": (proc.stdout + proc.stderr)[-2000:]}
            if proc.returncode != 0 and "error" not in body:
                body["exit_code"] = proc.returncode
        except subprocess.TimeoutExpired as err:
            try:  # what the section wrote before it was cut off, if anything
                body = json.loads(open(result.name).read() or "{}")
            except ValueError:
                body = {}
            body = {**body, "error": f"over its {limit(name)} s limit",
                    "tail": ((err.stdout or b"").decode(errors="replace"))[-2000:]
                    if isinstance(err.stdout, bytes) else str(err.stdout)[-2000:]}
    body["seconds"] = round(time.perf_counter() - start, 1)
    return body


def environment() -> dict:
    """What this machine is: torch, CUDA, the GPU."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "cpu_mode": device().type == "cpu", "cpus": os.cpu_count(),
            "host_memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                     / 2**30, 1)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return info


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; run the sections (or one child); write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="fewer configurations per section")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU over gloo (no GPU)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--child-largest", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["GPU_CHECK_CPU"] = "1"
    if args.child_largest:
        _largest_try(args.child_largest[0], int(args.child_largest[1]))
        return 0
    if args.child:
        try:
            body = _section(args.child)(args.quick)
        except Exception:  # noqa: BLE001 - reported to the parent
            body = {"error": traceback.format_exc()[-3000:]}
        with open(args.result, "w") as fh:
            json.dump(body, fh)
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu to check the script on the CPU", file=sys.stderr)
        return 2
    report = {"environment": environment(), "sections": {}}
    for name in [s for s in args.sections.split(",") if s]:
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; choose from {', '.join(SECTIONS)}")
        print(f"== {name}", flush=True)
        report["sections"][name] = run_section(name, args.quick)
        summary = {k: v for k, v in report["sections"][name].items() if k not in ("cells", "table")}
        print(json.dumps(summary)[:1500], flush=True)
        if "table" in report["sections"][name]:
            print(report["sections"][name]["table"], flush=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    print(f"report written to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
