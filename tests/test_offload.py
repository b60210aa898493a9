"""ZeRO-Offload and ZeRO-Infinity: every placement equals the same run without offload.

One world per size (1 and 2); inside it: stages 1-3 with the optimizer on CPU or NVMe, stage 3
with parameters on CPU or NVMe and with both offloaded, each with gradient accumulation and
clipping, compared with the same configuration without offload (fp32: 1e-6 relative); the memory
ledger's placement of every kind; no swap file left after `destroy()`; checkpoints saved from and
loaded into any placement; an injected write failure mid-step; and bad `nvme_path`s refused
before any step.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.offload import nvme
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

STEPS = 3
MICRO = 2
GAS = 2
CLIP = 0.05
WORLDS = (1, 2)

CASES = {  # name -> (stage, offload_optimizer device, offload_param device, pipelined NVMe I/O)
    "s1-opt-cpu": (1, "cpu", None, False),
    "s1-opt-nvme": (1, "nvme", None, False),
    "s2-opt-cpu": (2, "cpu", None, False),
    "s2-opt-nvme": (2, "nvme", None, True),
    "s3-opt-cpu": (3, "cpu", None, False),
    "s3-opt-nvme": (3, "nvme", None, True),
    "s3-param-cpu": (3, None, "cpu", False),
    "s3-param-nvme": (3, None, "nvme", False),
    "s3-both-cpu": (3, "cpu", "cpu", False),
    "s3-both-nvme": (3, "nvme", "nvme", True),
}


def _config(stage, opt=None, param=None, pipelined=False, root="", precision="fp32"):
    zero = {"stage": stage, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0}
    if stage < 3:
        zero.pop("stage3_param_persistence_threshold")
    if opt:
        zero["offload_optimizer"] = {"device": opt, "nvme_path": root, "pipeline_read": pipelined,
                                     "pipeline_write": pipelined}
    if param:
        zero["offload_param"] = {"device": param, "nvme_path": root, "buffer_count": 2}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8},
            "zero_optimization": zero}


def _engine(config):
    model = make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        config=config)
    return engine, model


def _train(engine, rank, world, steps=STEPS, seed=1):
    for batch in make_batches(steps, MICRO * GAS * world, seed=seed):
        for micro in range(GAS):
            tokens, targets = micro_slice(batch, micro, rank, world, MICRO)
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()


def _params(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)


def _swap_files(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".swp"))


def _run_placements(rank, world, root):
    out, baselines = {}, {}
    for stage in (1, 2, 3):
        engine, model = _engine(_config(stage))
        _train(engine, rank, world)
        engine.destroy()
        baselines[stage] = _params(model)
    for name, (stage, opt, param, pipelined) in CASES.items():
        engine, model = _engine(_config(stage, opt, param, pipelined, root))
        swap_during = len(_swap_files(root))
        _train(engine, rank, world)
        report = engine.memory_report()
        engine.destroy()
        out[name] = {"err": _rel(_params(model), baselines[stage]), "report": report,
                     "swap_during": swap_during, "swap_after": _swap_files(root)}
    # Mixed precision with the optimizer on NVMe equals the same precision without offload.
    for precision in ("bf16", "fp16"):
        results = []
        for opt in (None, "nvme"):
            engine, model = _engine(_config(2, opt, None, True, root, precision))
            _train(engine, rank, world)
            engine.destroy()
            results.append(_params(model))
        out[f"{precision}-s2-opt-nvme"] = {"err": _rel(results[1], results[0])}
    return out


def _run_checkpoints(rank, world, root, ckpt):
    """Save from NVMe offload, load into NVMe / CPU / no offload: all continue identically."""
    both_nvme = _config(3, "nvme", "nvme", True, root)
    engine, model = _engine(both_nvme)
    _train(engine, rank, world, steps=2)
    engine.save_checkpoint(ckpt, tag="mid")
    _train(engine, rank, world, steps=2, seed=7)
    engine.destroy()  # leaves the model whole
    straight = _params(model)
    out = {}
    for name, config in (("into-nvme", both_nvme), ("into-cpu", _config(3, "cpu", "cpu")),
                         ("into-none", _config(3)), ("into-s2-nvme", _config(2, "nvme", None, False, root))):
        engine, model = _engine(config)
        path, _ = engine.load_checkpoint(ckpt, tag="mid")
        _train(engine, rank, world, steps=2, seed=7)
        engine.destroy()
        out[name] = _rel(_params(model), straight)
    # And the other way round: saved without offload, loaded with both on NVMe.
    engine, model = _engine(_config(3))
    _train(engine, rank, world, steps=2)
    engine.save_checkpoint(ckpt, tag="plain")
    _train(engine, rank, world, steps=2, seed=7)
    engine.destroy()  # leaves the model whole
    straight = _params(model)
    engine, model = _engine(both_nvme)
    engine.load_checkpoint(ckpt, tag="plain")
    _train(engine, rank, world, steps=2, seed=7)
    engine.destroy()
    out["plain-into-nvme"] = _rel(_params(model), straight)
    return out


def _run_io_failures(rank, world, root, ckpt):
    """A write, then a read, that fails mid-step raises; further steps are refused; the
    checkpoint recovers both times (no staging buffer is lost on the way)."""
    config = _config(3, "nvme", "nvme", True, root)
    engine, model = _engine(config)
    _train(engine, rank, world, steps=1)
    engine.save_checkpoint(ckpt, tag="good")
    _train(engine, rank, world, steps=1, seed=5)
    engine.destroy()
    expected = _params(model)

    engine, model = _engine(config)
    engine.load_checkpoint(ckpt, tag="good")
    out = {}
    for name, op, error, files in (("write", "_pwrite", errno.ENOSPC, "-"),
                                   ("optimizer read", "_pread", errno.EIO, "optimizer-"),
                                   ("param read", "_pread", errno.EIO, "param-")):
        real, calls = getattr(nvme, op), [0]

        def failing(fd, view, offset, real=real, calls=calls, error=error, files=files):
            if files in os.readlink(f"/proc/self/fd/{fd}"):
                calls[0] += 1
                if calls[0] > 3:
                    raise OSError(error, os.strerror(error))
            return real(fd, view, offset)

        setattr(nvme, op, failing)
        messages = []
        try:
            for _ in range(2):
                try:
                    _train(engine, rank, world, steps=1, seed=5)
                except nvme.NvmeError as err:
                    messages.append(str(err))
        finally:
            setattr(nvme, op, real)
        engine.load_checkpoint(ckpt, tag="good")
        _train(engine, rank, world, steps=1, seed=5)
        out[name] = messages
    engine.destroy()
    out["recovered"] = _rel(_params(model), expected)
    out["swap_after"] = _swap_files(root)
    return out


def _run_bad_paths(rank, world, root):
    """nvme_path problems are reported at initialize(), naming the path and the sizes."""
    out = {}
    blocker = os.path.join(root, "a-file")
    with open(blocker, "w") as fh:
        fh.write("x")
    for name, path in (("under-a-file", os.path.join(blocker, "nvme")),):
        try:
            _engine(_config(2, "nvme", None, False, path))
            out[name] = None
        except nvme.NvmeError as err:
            out[name] = str(err)
    real = nvme.shutil.disk_usage
    nvme.shutil.disk_usage = lambda p: real(p)._replace(free=1 << 20)
    try:
        _engine(_config(3, None, "nvme", False, os.path.join(root, "small")))
        out["too-small"] = None
    except nvme.NvmeError as err:
        out["too-small"] = str(err)
    finally:
        nvme.shutil.disk_usage = real
    # A directory that does not exist yet is created; a second engine on it is refused.
    fresh = os.path.join(root, "new", "deeper")
    engine, _ = _engine(_config(1, "nvme", None, False, fresh))
    out["created"] = os.path.isdir(os.path.join(fresh, "zeroshard", "rank0"))
    try:
        _engine(_config(1, "nvme", None, False, fresh))
        out["in-use"] = None
    except nvme.NvmeError as err:
        out["in-use"] = str(err)
    engine.destroy()
    return out


def _run_destroy_without_gather(rank, world, root):
    """destroy(keep_parameters=False) deletes the swap files without gathering the model."""
    engine, model = _engine(_config(3, "nvme", "nvme", False, root))
    _train(engine, rank, world, steps=1)
    engine.destroy(keep_parameters=False)
    return {"empty": all(p.numel() == 0 for p in model.parameters() if p.requires_grad),
            "swap_after": _swap_files(root)}


def _all(rank, world):
    # Swap files in a directory of this rank's own; checkpoints in one all ranks share.
    ckpt = os.path.join(tempfile.gettempdir(), f"zs-offload-ckpt-{os.getppid()}-{world}")
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "nvme")
        out = {"placements": _run_placements(rank, world, root),
               "checkpoints": _run_checkpoints(rank, world, root, ckpt),
               "failure": _run_io_failures(rank, world, root, ckpt)}
        if world == 1:
            out["paths"] = _run_bad_paths(rank, world, tmp)
            out["no-gather"] = _run_destroy_without_gather(rank, world, root)
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"world{n}")
def world_results(request):
    """Per-rank results for one world size (checkpoints under a shared scratch directory)."""
    return request.param, run_world(request.param, _all)


@pytest.mark.parametrize("case", [*CASES, "bf16-s2-opt-nvme", "fp16-s2-opt-nvme"])
def test_offload_equals_no_offload(world_results, case):
    world, results = world_results
    tolerance = 1e-2 if case[1:4] == "f16" else 1e-6
    for rank, got in enumerate(results):
        err = got["placements"][case]["err"]
        assert err <= tolerance, f"world {world} rank {rank} {case}: relative error {err:.2e}"


@pytest.mark.parametrize("case", CASES)
def test_ledger_places_bytes_truthfully(world_results, case):
    world, results = world_results
    stage, opt, param, _ = CASES[case]
    for got in results:
        report = got["placements"][case]["report"]
        if opt:
            assert report["optimizer"][opt] > 0
            others = {p: b for p, b in report["optimizer"].items() if p != opt}
            assert not any(others.values()), f"{case}: optimizer bytes outside {opt}: {others}"
        else:
            assert report["optimizer"]["device"] > 0
        if param:
            assert report["params"][param] > 0
            # Between steps nothing of a sharded stage-3 unit stays on the device.
            assert report["params"]["device"] == 0, report["params"]
        # Sharded gradients live where the optimizer steps: CPU memory under optimizer offload.
        grads_at = "cpu" if opt and stage >= 2 else "device"
        assert report["grads"][grads_at] > 0
        assert sum(report["grads"].values()) == report["grads"][grads_at], report["grads"]


@pytest.mark.parametrize("case", CASES)
def test_swap_files_exist_while_training_and_go_away(world_results, case):
    _, results = world_results
    stage, opt, param, _ = CASES[case]
    for got in results:
        placed = got["placements"][case]
        assert (placed["swap_during"] > 0) == ("nvme" in (opt, param))
        assert placed["swap_after"] == []


@pytest.mark.parametrize("case", ["into-nvme", "into-cpu", "into-none", "into-s2-nvme",
                                  "plain-into-nvme"])
def test_checkpoints_cross_placements(world_results, case):
    world, results = world_results
    for rank, got in enumerate(results):
        err = got["checkpoints"][case]
        assert err <= 1e-6, f"world {world} rank {rank} {case}: relative error {err:.2e}"


def test_io_failures_are_reported_and_the_checkpoint_recovers(world_results):
    world, results = world_results
    for got in results:
        failure = got["failure"]
        for name, cause, what in (("write", "No space left on device", "write of"),
                                  ("optimizer read", "Input/output error", "read of")):
            failed, refused = failure[name]
            assert cause in failed and what in failed and ".swp" in failed, failed
            assert "partly applied" in failed and "load the last checkpoint" in failed
            assert "no optimizer step is taken" in refused
        # A parameter shard that cannot be read stops the forward before anything changed.
        for message in failure["param read"]:
            assert "Input/output error" in message and "param-u" in message
            assert "no parameter or optimizer state was changed" in message
        # After each failure, loading the checkpoint and stepping again gives the same weights
        # as a run that never failed (one step from the checkpoint, at the end).
        assert failure["recovered"] <= 1e-6
        assert failure["swap_after"] == []


def test_bad_nvme_paths_are_refused_before_any_step(world_results):
    world, results = world_results
    if world != 1:
        pytest.skip("checked in the world of one")
    paths = results[0]["paths"]
    assert paths["under-a-file"] and "cannot create" in paths["under-a-file"] and \
        "a-file" in paths["under-a-file"]
    small = paths["too-small"]
    assert small and "offload_param.nvme_path" in small and "needs" in small and \
        "1048576 bytes) free" in small
    assert paths["created"]
    assert paths["in-use"] and "in use by another zeroshard process" in paths["in-use"]


def test_destroy_can_leave_the_model_ungathered(world_results):
    world, results = world_results
    if world != 1:
        pytest.skip("checked in the world of one")
    got = results[0]["no-gather"]
    assert got["empty"] and got["swap_after"] == []


EXIT_SCRIPT = """
import sys, torch, zeroshard
from tests.models import lm_loss, make_batches, make_model
root = sys.argv[1]
model = make_model()
engine, _, _, _ = zeroshard.initialize(
    model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
    config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": root},
        "offload_param": {"device": "nvme", "nvme_path": root}}})
tokens, targets = make_batches(1, 2)[0]
engine.backward(lm_loss(engine(tokens), targets))
engine.step()
import os
print(sum(f.endswith(".swp") for _, _, fs in os.walk(root) for f in fs))
# no engine.destroy(): the files must go at a normal exit anyway
"""


def test_swap_files_go_away_at_normal_exit_without_destroy(tmp_path):
    root = tmp_path / "nvme"
    env = dict(os.environ, ZEROSHARD_QUIET="1", PYTHONPATH=str(Path(__file__).parent.parent))
    res = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(root)], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip().splitlines()[-1]) > 0  # they existed while it ran
    assert _swap_files(str(root)) == []
