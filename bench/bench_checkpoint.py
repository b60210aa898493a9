"""Checkpoint benchmark: zeroshard vs DeepSpeed save/load time and bytes, and consolidation memory.

A GPT-2-style model of ~100 M parameters (14 x 768, byte vocabulary), fp32 AdamW, two gloo ranks,
ZeRO stages 2 and 3. Each (implementation, stage) runs as its own torchrun job: one training step
(so the optimizer state exists), then `--repeats` saves and loads, each timed between barriers.
Then each implementation's offline consolidation of the stage-3 checkpoint to one safetensors
file runs in a fresh process, and its peak RSS rise is measured: `zeroshard consolidate` vs
DeepSpeed's `zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict` (which writes
pytorch_model.bin: its safetensors option refuses the tied GPT-2 weights).

    python bench/bench_checkpoint.py            # ~5 minutes on 2 cores, ~6 GB of scratch disk
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

LAYERS, WIDTH, VOCAB = 14, 768, 256


def _model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=12, n_positions=128,
                                      vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def worker(impl: str, stage: int, root: str, repeats: int) -> None:
    """One torchrun job: a step, then timed saves and loads."""
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    zero = {"stage": stage, "reduce_bucket_size": 10_000_000}
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    if impl == "deepspeed":
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")
        cfg.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    else:
        import zeroshard

        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=opt, config=cfg)
    rank = dist.get_rank()
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    saves, loads = [], []
    for i in range(repeats):
        tag = f"t{i}"
        dist.barrier()
        start = time.perf_counter()
        engine.save_checkpoint(root, tag=tag)
        dist.barrier()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.load_checkpoint(root, tag=tag)
        dist.barrier()
        loads.append(time.perf_counter() - start)
    if rank == 0:
        result = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                  "bytes": _du(os.path.join(root, "t0")),
                  "params": sum(p.numel() for p in _model().parameters())}
        with open(os.path.join(root, "result.json"), "w") as fh:
            json.dump(result, fh)
        for i in range(1, repeats):  # keep one tag for the consolidation measurement
            shutil.rmtree(os.path.join(root, f"t{i}"), ignore_errors=True)
    dist.barrier()


CONSOLIDATE = """
import os, resource, sys
impl, ckpt, out = sys.argv[1:4]
if impl == "deepspeed":
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as run
    import logging, deepspeed; deepspeed.utils.logger.setLevel(logging.WARNING)
    go = lambda: run(ckpt, out, tag="t0")  # .bin: its safetensors path fails on tied weights
else:
    from zeroshard.consolidate import consolidate
    go = lambda: consolidate(ckpt, out, tag="t0")
before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import time; start = time.perf_counter(); go(); took = time.perf_counter() - start
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before, took)
"""


def main() -> None:
    repeats = 3
    scratch = tempfile.mkdtemp(prefix="zs-ckpt-bench-")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "ZEROSHARD_QUIET": "1", "OMP_NUM_THREADS": "1"}
    rows = {}
    try:
        for stage in (2, 3):
            for impl in ("zeroshard", "deepspeed"):
                root = os.path.join(scratch, f"{impl}-s{stage}")
                done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc-per-node", "2", __file__, "--worker", impl,
                                       str(stage), root, str(repeats)],
                                      env=env, capture_output=True, text=True)
                result_file = os.path.join(root, "result.json")
                if not os.path.isfile(result_file):
                    sys.exit(f"{impl} stage {stage} failed:\n{done.stderr[-4000:]}")
                rows[(impl, stage)] = json.load(open(result_file))
                if stage == 3:
                    out = os.path.join(scratch, f"{impl}-consolidated")
                    measured = subprocess.run([sys.executable, "-c", CONSOLIDATE, impl, root, out],
                                              env=env, capture_output=True, text=True)
                    if measured.returncode != 0:
                        sys.exit(f"{impl} consolidation failed:\n{measured.stderr[-4000:]}")
                    rise, took = measured.stdout.split()[-2:]
                    rows[(impl, "consolidate")] = {"rise": int(rise), "seconds": float(took)}
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    params = rows[("zeroshard", 2)]["params"]
    mib = 2**20
    print(f"# checkpoint bench — GPT-2 {LAYERS}x{WIDTH}, {params:,} params, fp32 AdamW, 2 gloo "
          f"ranks, median of {repeats} save/load pairs\n")
    print("| stage | impl | save s | load s | bytes written MiB | save vs DeepSpeed | load vs DeepSpeed |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for stage in (2, 3):
        ds = rows[("deepspeed", stage)]
        for impl in ("zeroshard", "deepspeed"):
            r = rows[(impl, stage)]
            print(f"| {stage} | {impl} | {r['save_s']:.2f} | {r['load_s']:.2f} | "
                  f"{r['bytes'] / mib:.0f} | {r['save_s'] / ds['save_s']:.2f}x | "
                  f"{r['load_s'] / ds['load_s']:.2f}x |")
    print("\n| consolidation of the stage-3 checkpoint to safetensors | peak RSS rise MiB | seconds |")
    print("|---|---:|---:|")
    for impl, label in (("zeroshard", "zeroshard consolidate"),
                        ("deepspeed", "DeepSpeed zero_to_fp32")):
        r = rows[(impl, "consolidate")]
        print(f"| {label} | {r['rise'] / mib:.0f} | {r['seconds']:.1f} |")
    print(f"\nfp32 model: {4 * params / mib:.0f} MiB")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        main()
