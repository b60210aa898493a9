"""Stage 3 never holds the whole model: each rank's peak memory per phase, at world size 4, against
a bound computed from the model (shards + a few modules or units), where the whole model would
clearly break it.

Model: 64 x Linear(1024, 1024), fp32, SGD: Psi = 67.2 M parameters, 256 MiB whole; a module (and
a stage-3 unit) is 4 MiB, a rank's shards are 64 MiB. Bounds per rank:
  construction under zeroshard.Init            <= shards + 4 modules                   (80 MiB)
  initialize() + first step, Init-built model  <= shards + gradient shards + 8 units   (160 MiB)
  initialize() + first step, model built whole <= the same, above the built model; and afterwards
                                                  the whole model's memory is gone
Peak: the kernel's high-water mark (VmHWM, reset before each phase through /proc/self/clear_refs)
minus the resident memory when the phase starts. A warm-up run of the same phases on a tiny model
first makes the code pages the phases touch resident, so that the rise is the library's memory.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_world

WORLD = 4
LAYERS, WIDTH = 64, 1024
MiB = 1 << 20
CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(key + r":\s+(\d+)", fh.read()).group(1)) * 1024


def _trimmed_anon() -> int:
    """Anonymous resident bytes after handing glibc's free lists back to the kernel.

    Freed 4 MiB blocks can stay in the heap (glibc raises its mmap threshold after the first such
    free), so without the trim the count depends on what the process did before, not on what the
    library still references."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _status("RssAnon")


def _phase(fn):
    """Run `fn()`; return (its result, peak resident bytes above the start)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    start = _status("VmRSS")
    result = fn()
    return result, _status("VmHWM") - start


def _build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _train_once(model):
    engine, _, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    x = torch.randn(2, model[0].in_features)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    return engine


def _phases(layers: int, width: int) -> dict:
    out = {}
    with zeroshard.Init(config=CONFIG):
        probe = nn.Linear(width, width)  # the module size, measured from the real thing
    out["module"] = sum(p.ds_numel for p in probe.parameters()) * 4
    del probe
    # Built under Init: construction, then initialize() + one step.
    model, out["construct"] = _phase(lambda: _init_build(layers, width))
    out["shards"] = sum(u.shard.numel() * 4 for u in zeroshard.core.init.init_units(model))
    engine, out["init_step"] = _phase(lambda: _train_once(model))
    out["unit"] = max(u.padded_numel for u in engine.optimizer.units) * 4
    out["grad_shards"] = sum(s.numel() * 4 for s in engine.optimizer.policy.grad_tensors())
    engine.destroy(keep_parameters=False)
    del engine, model
    # Built whole, as usual: the rise above the built model, and what is left afterwards.
    before_model = _trimmed_anon()
    model = _build(layers, width)
    engine, out["init_step_whole"] = _phase(lambda: _train_once(model))
    out["left_whole"] = _trimmed_anon() - before_model
    engine.destroy(keep_parameters=False)
    return out


def _init_build(layers: int, width: int):
    with zeroshard.Init(config=CONFIG):
        return _build(layers, width)


def _measure(rank, world):
    _phases(2, 64)  # warm-up: code pages and allocator arenas of every phase
    return _phases(LAYERS, WIDTH)


@pytest.fixture(scope="module")
def phases():
    """Per-rank peak rises of each phase for the large model."""
    return run_world(WORLD, _measure)


def test_the_whole_model_would_break_the_bounds(phases):
    got = phases[0]
    whole = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    assert got["shards"] * WORLD == pytest.approx(whole, rel=0.01)
    assert whole > 1.5 * (got["shards"] + got["grad_shards"] + 8 * got["unit"])
    assert whole > 3 * (got["shards"] + 4 * got["module"])


def test_construction_under_init_holds_shards_and_a_few_modules(phases):
    for rank, got in enumerate(phases):
        bound = got["shards"] + 4 * got["module"]
        assert got["construct"] <= bound, \
            f"rank {rank}: construction rose {got['construct'] / MiB:.0f} MiB > {bound / MiB:.0f}"


@pytest.mark.parametrize("built", ["init", "whole"])
def test_initialize_and_first_step_hold_shards_and_a_few_units(phases, built):
    for rank, got in enumerate(phases):
        rise = got["init_step"] if built == "init" else got["init_step_whole"]
        bound = got["shards"] + got["grad_shards"] + 8 * got["unit"]
        assert rise <= bound, \
            f"rank {rank}: initialize + step rose {rise / MiB:.0f} MiB > {bound / MiB:.0f}"


def test_the_whole_model_is_gone_after_initialize(phases):
    for rank, got in enumerate(phases):
        bound = got["shards"] + got["grad_shards"] + 8 * got["unit"]
        assert got["left_whole"] <= bound, \
            f"rank {rank}: {got['left_whole'] / MiB:.0f} MiB left > {bound / MiB:.0f}"
