"""Spawn a world of N real gloo ranks on CPU once, run many cases inside it, return rank results.

Starting ranks costs seconds on 2 cores, so a test module spawns each world size once (in a
module-scoped fixture), runs every case in that world, and its tests assert on the results.
"""

from __future__ import annotations

import datetime
import os
import time
import pickle
import socket
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Ranks are forked from a server process that has imported torch and zeroshard once, instead of
# each importing them anew (seconds of CPU per rank on 2 cores). Each rank still starts from a
# fresh process image of that server, and gets the parent's environment as spawn would give it.
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.multiprocessing",
                                 "zeroshard", "zeroshard.engine", "tests.harness", "tests.models",
                                 # the Hugging Face tests' models (skipped where not installed)
                                 "transformers.models.gpt2.modeling_gpt2",
                                 "transformers.models.llama.modeling_llama"])


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), ZEROSHARD_QUIET="1")
    torch.set_num_threads(1)
    # A short collective timeout turns a rank stuck on a failed peer into an error, not a hang.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - the parent re-raises with the rank's traceback
        payload = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(payload, fh)
    try:
        dist.barrier()  # nobody leaves while a peer may still be talking to it
    except Exception:  # noqa: BLE001 - the result is written; a failed peer is reported by it
        pass
    # Leave without running C++ destructors: tearing gloo down while peers exit at slightly
    # different moments can abort ("terminate called without an active exception") after the
    # work is done and the result written.
    os._exit(0)


def run_world(world_size: int, fn, *args, timeout: float = 600) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world_size, _free_port(), out_dir, fn, args,
                                               dict(os.environ)),
                                 nprocs=world_size, join=False, start_method="forkserver")
        try:
            _join(ctx, timeout)
            crash = None
        except Exception as err:  # noqa: BLE001 - a rank's own error, if it wrote one, says more
            crash = err
        payloads = {}
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    payloads[rank] = pickle.load(fh)
        for rank, (status, value) in sorted(payloads.items()):
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
        if len(payloads) < world_size:
            missing = sorted(set(range(world_size)) - set(payloads))
            raise RuntimeError(f"world of {world_size}: ranks {missing} wrote no result ({crash})")
        if crash is not None:
            # Every rank finished its work and wrote its result; what failed was gloo's teardown
            # as the processes left (seen as SIGABRT at exit with 4 ranks on 2 cores).
            warnings.warn(f"world of {world_size}: a rank aborted after writing its result "
                          f"({crash})", RuntimeWarning, stacklevel=2)
        return [payloads[rank][1] for rank in range(world_size)]


def _join(ctx, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            raise TimeoutError(f"world did not finish within {timeout:.0f}s")
