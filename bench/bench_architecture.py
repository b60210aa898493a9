"""The shape of the code, measured: what issue 36 asks to report before and after a refactor.

Prints, for the source tree this script runs against (`PYTHONPATH=<tree>/src` picks another):
  1. classes longer than 250 lines (in core/, and in the whole package), with their sizes;
  2. the package files one stage-3 training step passes through (forward, backward, step) on rank 0
     of a 2-rank gloo world, and every call edge from dist/ into core/ seen during that step;
  3. the import time of `import zeroshard` on top of an already imported torch (median of 5
     fresh interpreters): wall time, and the CPU time of the importing process (the steadier
     figure on a loaded machine).

    python bench/bench_architecture.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def package_dir() -> Path:
    """The zeroshard package this interpreter imports."""
    import importlib.util
    return Path(importlib.util.find_spec("zeroshard").origin).parent


def long_classes(root: Path, limit: int = 250) -> list[tuple[str, int]]:
    """`(module:Class, lines)` of every class over `limit` lines under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > limit:
                    out.append((f"{path.relative_to(root.parent)}:{node.name}", size))
    return sorted(out, key=lambda item: -item[1])


def _step_worker(rank: int, world: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zeroshard
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
                                  for _ in range(4)], torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "reduce_bucket_size": 4096,
                                    "stage3_prefetch_bucket_size": 8192}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    batch = torch.randn(4, 64)

    def step():
        loss = engine(batch).pow(2).mean()
        engine.backward(loss)
        engine.step()

    step()
    step()  # warm: the recorded schedule exists
    pkg = str(package_dir())
    files: set[str] = set()
    edges: set[tuple[str, str]] = set()

    def profile(frame, event, _arg):
        if event != "call":
            return
        name = frame.f_code.co_filename
        if not name.startswith(pkg):
            return
        here = os.path.relpath(name, pkg)
        files.add(here)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(pkg):
            caller = caller.f_back  # through torch's own frames (hooks, autograd)
        if caller is not None:
            edges.add((os.path.relpath(caller.f_code.co_filename, pkg), here))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    if rank == 0:
        up = sorted(f"{a} -> {b}" for a, b in edges
                    if a.startswith("dist/") and b.startswith("core/"))
        queue.put({"files": sorted(files), "dist_to_core": up})
    dist.barrier()
    dist.destroy_process_group()


def step_files() -> dict:
    """Package files a warmed-up stage-3 step passes through on rank 0 of 2, and dist->core edges."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_step_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def import_seconds(runs: int = 5) -> tuple[float, float]:
    """Median (wall, CPU) seconds of `import zeroshard` after `import torch`, each in a fresh
    interpreter."""
    code = ("import time, torch; t, c = time.perf_counter(), time.process_time(); "
            "import zeroshard; print(time.perf_counter() - t, time.process_time() - c)")
    pairs = [subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.split() for _ in range(runs)]
    return (statistics.median(float(w) for w, _ in pairs),
            statistics.median(float(c) for _, c in pairs))


def main() -> None:
    """Print the three figures (and write them as JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    pkg = package_dir()
    core_long = long_classes(pkg / "core")
    all_long = long_classes(pkg)
    steps = step_files()
    wall, cpu = import_seconds()
    print(f"package: {pkg}")
    print(f"classes over 250 lines: {len(core_long)} in core, {len(all_long)} in the package")
    for name, size in all_long:
        print(f"  {size:4d}  {name}")
    print(f"files a stage-3 step passes through: {len(steps['files'])}")
    for name in steps["files"]:
        print(f"  {name}")
    print(f"calls from dist/ into core/ during the step: {len(steps['dist_to_core'])}")
    for edge in steps["dist_to_core"]:
        print(f"  {edge}")
    print(f"import zeroshard over torch: {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU "
          "(medians of 5)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "long_classes_core": core_long, "long_classes": all_long,
            "step_files": steps["files"], "dist_to_core": steps["dist_to_core"],
            "import_ms": wall * 1000, "import_cpu_ms": cpu * 1000}, indent=1))


if __name__ == "__main__":
    main()
