"""Strict host mode (`dist/hostmem.py`), on for the whole suite (`tests/conftest.py`): host memory
never reaches the default (NCCL-bound) process group and never meets device memory in the
library's host-side code, as on a GPU machine. And what it catches:

- the comm wrapper refuses a host tensor on the default group in every collective, naming the
  call site; device tensors and a gloo side group made for host traffic pass; with
  ZEROSHARD_STRICT_HOST=0 nothing is checked;
- `host_region()` marks what is computed from host memory and refuses host/device mixes;
- each bug it found stays caught: with its fix undone (patched back in a rank), the gradient-norm
  all-reduce under optimizer offload, Init's broadcast of a module built on the CPU, the
  broadcast of buffers of a model built on the CPU, stage 2's gradients landing in host memory
  and stage 1's device gradients stepped with host masters (CPU and NVMe offload) all raise
  HostMemoryError;
- the stage x placement x precision matrix runs under it, equals the same run without offload,
  saves and loads checkpoints, and leaves parameters reporting the compute device;
- every torch factory call of the library names its device (host memory goes through hostmem);
- a gloo group given device tensors (two ranks sharing one GPU) runs each collective on host
  copies: forced here on CPU tensors, every collective (async too, all-gather with the shard
  aliasing its own slot) and two steps at stages 1-3 equal the unstaged run bitwise.
"""

from __future__ import annotations

import ast
import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.dist import Comm, HostMemoryError
from zeroshard.dist import hostmem
from tests.harness import run_world
from tests.models import make_model
from tests.test_offload import _config, _engine, _params, _rel, _train

WORLD = 2
PRECISIONS = ("fp32", "bf16", "fp16")
PLACEMENTS = [(stage, opt, param) for stage in (1, 2, 3) for opt in (None, "cpu", "nvme")
              for param in ((None, "cpu", "nvme") if stage == 3 else (None,))]


def test_the_suite_runs_in_strict_mode():
    assert os.environ.get("ZEROSHARD_STRICT_HOST") == "1"
    assert hostmem.strict_host()


# -- hostmem on its own (no process group) -------------------------------------------------------

def test_host_memory_is_marked_on_the_storage_and_moves_copy():
    host = hostmem.host_zeros(8)
    assert hostmem.is_host(host) and hostmem.is_host(host[2:5])  # every view
    moved = hostmem.to_device(host, torch.device("cpu"))
    assert not hostmem.is_host(moved) and moved.data_ptr() != host.data_ptr()
    device = torch.ones(8)
    back = hostmem.to_host(device)
    assert hostmem.is_host(back) and back.data_ptr() != device.data_ptr()
    assert hostmem.to_host(host) is host
    assert hostmem.is_host(hostmem.host_copy(host)) and not hostmem.on_device(host, host.device)


def test_host_region_marks_results_and_refuses_mixes():
    host, device = hostmem.host_zeros(4), torch.ones(4)
    with hostmem.host_region():
        assert hostmem.is_host(host * 2)
        assert hostmem.is_host(torch.stack(torch._foreach_norm([host])).sum())
        host.add_(torch.tensor(1.0))  # a 0-dim CPU tensor may join any op, as on CUDA
        host.copy_(device)  # copies are how values cross
        with pytest.raises(HostMemoryError, match=r"aten.add_.Tensor at test_strict_host.py:\d+"):
            host.add_(device)
        with pytest.raises(HostMemoryError, match="to_host / to_device"):
            torch.cat([host, device])
    assert not hostmem.is_host(device * 2)  # outside the region nothing is traced


def test_outside_strict_mode_nothing_is_checked(monkeypatch):
    monkeypatch.setenv("ZEROSHARD_STRICT_HOST", "0")
    host = hostmem.host_zeros(4)
    with hostmem.host_region():
        host.add_(torch.ones(4))
    assert hostmem.to_host(torch.ones(4)).device.type == "cpu"
    on_cpu = torch.ones(4)
    assert hostmem.to_device(on_cpu, torch.device("cpu")) is on_cpu  # no copy on a CPU machine


# Library code that places tensors (dist/: the ledgered comm); cli/ (the demo's data) and sizing/
# are user code or build nothing.
PLACING = ("dist", "engine.py", "core", "offload", "checkpoint")
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
             "empty_strided", "linspace", "eye", "as_tensor"}


def test_every_factory_call_of_the_library_names_its_device():
    """`torch.zeros(1)` is CPU memory, i.e. host memory on a GPU machine: the library says where
    each tensor goes (`device=...`), or allocates host memory through dist/hostmem.py."""
    root = Path(zeroshard.__file__).parent
    unnamed = []
    for part in PLACING:
        paths = [root / part] if part.endswith(".py") else sorted((root / part).rglob("*.py"))
        for path in paths:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name) and \
                        node.func.value.id == "torch" and \
                        not any(k.arg == "device" for k in node.keywords):
                    unnamed.append(f"{path.relative_to(root)}:{node.lineno} torch.{node.func.attr}")
    assert not unnamed, "factory calls without device=: " + ", ".join(unnamed)


# -- in a world of two ----------------------------------------------------------------------------

def _comm_checks(rank, world):
    comm = Comm()
    out = {}
    host = hostmem.host_zeros(world * 4)
    calls = {"all_reduce": lambda: comm.all_reduce(host),
             "broadcast": lambda: comm.broadcast(host, src=0),
             "all_gather": lambda: comm.all_gather(host, host[:4]),
             "reduce_scatter": lambda: comm.reduce_scatter(host),
             "all_to_all": lambda: comm.all_to_all(host, host, [4] * world, [4] * world)}
    for kind, call in calls.items():
        try:
            call()
            out[kind] = None
        except HostMemoryError as err:
            out[kind] = str(err)
    device = torch.ones(world * 4)
    comm.all_reduce(device)
    out["device_ok"] = bool((device == world).all())
    side = Comm(torch.distributed.new_group(backend="gloo"), host=True)
    side.all_reduce(host)  # a gloo group made for host traffic takes host memory
    os.environ["ZEROSHARD_STRICT_HOST"] = "0"
    try:
        Comm().all_reduce(host)  # not strict: nothing is checked
    finally:
        os.environ["ZEROSHARD_STRICT_HOST"] = "1"
    return out


def _collectives(comm, rank, world) -> dict:
    """One call of each collective on fresh rank-dependent tensors; what each left."""
    got = {}
    tensor = torch.arange(world * 4, dtype=torch.float32) + 10 * rank
    comm.all_reduce(tensor, async_op=True).wait()
    got["all_reduce"] = tensor
    tensor = torch.arange(world * 4, dtype=torch.float32) + 10 * rank
    comm.broadcast(tensor, src=world - 1)
    got["broadcast"] = tensor
    full = torch.zeros(world * 4)
    full[rank * 4:(rank + 1) * 4] = rank + 1.5
    comm.all_gather(full, full[rank * 4:(rank + 1) * 4])  # the shard aliases its own slot
    got["all_gather"] = full
    full = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    comm.reduce_scatter(full, async_op=True).wait()
    got["reduce_scatter"] = full[rank * 4:(rank + 1) * 4].clone()
    rows = torch.arange(2 * world * 3, dtype=torch.float32).view(2, world, 3) * (rank + 1)
    comm.reduce_scatter_rows(rows)
    got["reduce_scatter_rows"] = rows[:, rank].clone()
    received, sent = torch.empty(world * 2), torch.arange(world * 2, dtype=torch.float32) + 9 * rank
    comm.all_to_all(received, sent, [2] * world, [2] * world)
    got["all_to_all"] = received
    return got


def _staged(rank, world, root):
    """Collectives and training with every collective staged through host copies (as a gloo
    group does with device tensors) against the same without staging."""
    plain = _collectives(Comm(), rank, world)
    forced = Comm()
    forced._on_host = lambda *tensors: True
    staged = _collectives(forced, rank, world)
    out = {kind: bool(torch.equal(plain[kind], staged[kind])) for kind in plain}
    original = Comm._on_host
    for stage in (1, 2, 3):
        runs = []
        for force in (False, True):
            if force:
                Comm._on_host = lambda self, *tensors: True
            try:
                engine, model = _engine(_config(stage, root=root))
                _train(engine, rank, world, steps=2)
                engine.destroy()
            finally:
                Comm._on_host = original
            runs.append(_params(model))
        out[f"stage{stage}"] = all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    return out


def _small_config(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                  "stage3_param_persistence_threshold": 0, **zero}}


class WithBuffer(nn.Module):
    """A model with a buffer (BatchNorm's running statistics) next to its parameters."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return self.norm(self.lin(x))


def _one_step(stage, model=None, **zero):
    """initialize() and one step of TinyLM (or `model`, a WithBuffer) at `stage`."""
    x = torch.randint(0, 23, (2, 6)) if model is None else torch.randn(2, 6)
    model = model or make_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=_small_config(stage, **zero))
    try:
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    finally:
        engine.optimizer.policy.reset()  # a backward cut short leaves collectives in flight
        engine.destroy()


def _build_under_init():
    with zeroshard.Init(config=_small_config(3)):
        make_model()


def _undone(module, name, replacement, run):
    """Run `run()` with `module.name` replaced (a fix undone); the strict-mode error, or None."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        run()
        return None
    except HostMemoryError as err:
        return str(err)
    finally:
        setattr(module, name, original)


def _caught(rank, world, root):
    from zeroshard import build as build_module
    from zeroshard.core import grad_norm, grad_reducer, init_units
    from zeroshard.offload import nvme_optimizer as nvme_placement
    from zeroshard.offload import optimizer as placements

    cpu, nvme = {"device": "cpu"}, {"device": "nvme", "nvme_path": root}
    return {
        "norm": _undone(grad_norm, "to_device", lambda t, d: t,
                        lambda: _one_step(2, offload_optimizer=cpu)),
        "init": _undone(init_units, "to_device", lambda t, d: t, _build_under_init),
        "buffers": _undone(build_module, "to_device", lambda t, d: t,
                           lambda: _one_step(2, model=WithBuffer())),
        "landing": _undone(grad_reducer, "to_host", lambda t, *a: t,
                           lambda: _one_step(2, offload_optimizer=cpu)),
        "stage1": _undone(placements, "to_host", lambda t, dtype=None: t.to(dtype or t.dtype),
                          lambda: _one_step(1, offload_optimizer=cpu)),
        "stage1-nvme": _undone(nvme_placement, "to_host",
                               lambda t, dtype=None: t.to(dtype or t.dtype),
                               lambda: _one_step(1, offload_optimizer=nvme)),
    }


def _matrix(rank, world, root, ckpt):
    out = {}
    for precision in PRECISIONS:
        baselines = {}
        for stage, opt, param in PLACEMENTS:
            engine, model = _engine(_config(stage, opt, param, True, root, precision))
            _train(engine, rank, world, steps=2)
            placed = all(p.device == engine.device and not hostmem.is_host(p)
                         for p in model.parameters())
            if opt or param:  # checkpoints of offloaded state, under strict mode
                engine.save_checkpoint(ckpt, tag="t")
                engine.load_checkpoint(ckpt, tag="t")
            _train(engine, rank, world, steps=1, seed=5)
            engine.destroy()
            values = _params(model)
            if not opt and not param:
                baselines[stage] = values
                err = 0.0
            else:
                err = _rel(values, baselines[stage])
            out[(precision, stage, opt, param)] = {"err": err, "placed": placed}
    return out


def _all(rank, world):
    # Swap files in a directory of this rank's own; checkpoints in one all ranks share.
    ckpt = os.path.join(tempfile.gettempdir(), f"zs-strict-ckpt-{os.getppid()}")
    with tempfile.TemporaryDirectory() as tmp:
        out = {"comm": _comm_checks(rank, world), "staged": _staged(rank, world, tmp),
               "caught": _caught(rank, world, tmp),
               "matrix": _matrix(rank, world, os.path.join(tmp, "nvme"), ckpt)}
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def results():
    """Per-rank results in a world of two."""
    return run_world(WORLD, _all)


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                  "all_to_all"])
def test_the_default_group_refuses_host_memory_naming_the_call_site(results, kind):
    for got in results:
        message = got["comm"][kind]
        assert message is not None, f"{kind} accepted a host tensor on the default group"
        assert f"{kind} at test_strict_host.py:" in message and "(<lambda>)" in message
        assert "NCCL" in message and "to_device" in message
        assert got["comm"]["device_ok"]


@pytest.mark.parametrize("what", ["all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                  "reduce_scatter_rows", "all_to_all", "stage1", "stage2",
                                  "stage3"])
def test_gloo_with_device_tensors_runs_on_host_copies(results, what):
    for rank, got in enumerate(results):
        assert got["staged"][what], f"rank {rank}: {what} differs when staged through the host"


@pytest.mark.parametrize("bug,where", [
    ("norm", "all_reduce at grad_norm.py"), ("init", "broadcast at init_units.py"),
    ("buffers", "broadcast at build.py"), ("landing", "aten.add_.Tensor at grad_reducer.py"),
    ("stage1", "aten._fused_adamw_.default at optimizer.py"),
    ("stage1-nvme", "aten._fused_adamw_.default at nvme_optimizer.py")])
def test_strict_mode_catches_each_bug_it_found(results, bug, where):
    for got in results:
        message = got["caught"][bug]
        assert message is not None and where in message, message


@pytest.mark.parametrize("case", [(p, *placement) for p, placement in
                                  itertools.product(PRECISIONS, PLACEMENTS)],
                         ids=lambda c: f"{c[0]}-s{c[1]}-opt{c[2]}-param{c[3]}")
def test_stage_placement_precision_matrix(results, case):
    tolerance = 1e-6 if case[0] == "fp32" else 1e-2
    for rank, got in enumerate(results):
        cell = got["matrix"][case]
        assert cell["err"] <= tolerance, f"rank {rank}: relative error {cell['err']:.2e}"
        assert cell["placed"], "a parameter reports another device than the compute device"
