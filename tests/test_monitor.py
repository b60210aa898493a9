"""A run you can watch (zeroshard.monitor): TensorBoard and CSV monitors, the steps_per_print line,
wall_clock_breakdown, the flops profile and engine.monitor, checked against plain torch.

One world of 2 gloo ranks trains TinyLM at stage 3 with accumulation; the loss curve read back
from the TensorBoard event file (with tensorboard's own EventAccumulator) and from the CSV file
equals rank 0's losses recomputed by a single-process plain-torch run of the same steps.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import tempfile

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zeroshard
from zeroshard.config import ConfigError, load_config
from zeroshard.monitor import MissingPackageError, MonitorMaster, mfu, peak_flops
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

MICRO, GAS, STEPS, LR = 2, 2, 4, 1e-2
PROFILE_STEP = 1


def _reference(world: int, batches) -> tuple[list[float], int]:
    """Rank 0's mean micro-step loss at each step of plain single-process training on the global
    batch, and the FLOPs of step PROFILE_STEP's forwards and backwards on rank 0's micro-batches."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, flops = [], 0
    for step, (tokens, targets) in enumerate(batches):
        with torch.no_grad():
            rank0 = [lm_loss(model(t), y) for t, y in
                     (micro_slice((tokens, targets), m, 0, world, MICRO) for m in range(GAS))]
        losses.append(torch.stack(rank0).mean().item())
        if step == PROFILE_STEP:
            with FlopCounterMode(display=False) as counter:
                for m in range(GAS):
                    t, y = micro_slice((tokens, targets), m, 0, world, MICRO)
                    lm_loss(model(t), y).backward()
            flops = counter.get_total_flops()
            model.zero_grad()
        opt.zero_grad()
        lm_loss(model(tokens), targets).backward()
        opt.step()
    return losses, flops


def _train_watched(rank, world) -> dict:
    root = tempfile.mkdtemp(prefix=f"zs_monitor_{rank}_")
    batches = make_batches(STEPS, MICRO * GAS * world)
    ref_losses, ref_flops = _reference(world, batches)
    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0, "steps_per_print": 2, "wall_clock_breakdown": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "tensorboard": {"enabled": True, "output_path": os.path.join(root, "tb"),
                        "job_name": "run1"},
        "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"),
                        "job_name": "run1"},
        "flops_profiler": {"enabled": True, "profile_step": PROFILE_STEP, "module_depth": 1,
                           "output_file": os.path.join(root, "flops.txt")}}
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=LR), config=config)
    printed = io.StringIO()
    os.environ["ZEROSHARD_QUIET"] = "0"  # the harness silences the log line; this test reads it
    try:
        with contextlib.redirect_stdout(printed):
            for batch in batches:
                for m in range(GAS):
                    tokens, targets = micro_slice(batch, m, rank, world, MICRO)
                    engine.backward(lm_loss(engine(tokens), targets))
                    engine.step()
    finally:
        os.environ["ZEROSHARD_QUIET"] = "1"
    engine.monitor.close()
    return {"root": root, "printed": printed.getvalue(), "ref_losses": ref_losses,
            "ref_flops": ref_flops, "monitor_enabled": engine.monitor.enabled,
            "train_batch": engine.train_batch_size(),
            "exists": {name: os.path.exists(os.path.join(root, name))
                       for name in ("tb", "csv", "flops.txt")}}


@pytest.fixture(scope="module")
def results():
    out = run_world(2, _train_watched)
    yield out
    import shutil

    for r in out:
        shutil.rmtree(r["root"], ignore_errors=True)


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_file_holds_the_loss_curve(results):
    pytest.importorskip("tensorboard")
    r = results[0]
    scalars = _scalars(os.path.join(r["root"], "tb", "run1"))
    steps = [r["train_batch"] * (i + 1) for i in range(STEPS)]  # DeepSpeed's x axis: samples
    loss = scalars["Train/Samples/train_loss"]
    assert [s for s, _ in loss] == steps
    assert [v for _, v in loss] == pytest.approx(r["ref_losses"], rel=1e-5)
    assert r["ref_losses"][-1] < r["ref_losses"][0]  # a curve that goes somewhere
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx([LR] * STEPS)
    for phase in ("forward", "backward", "step"):
        times = [v for _, v in scalars[f"Train/Samples/elapsed_time_ms_{phase}"]]
        assert len(times) == STEPS and all(t > 0 for t in times)
    assert "Train/Samples/loss_scale" not in scalars  # fp16 only
    rates = [v for _, v in scalars["Train/Samples/tokens_per_sec"]]
    assert len(rates) == STEPS and all(v > 0 for v in rates)


def test_csv_monitor_writes_deepspeeds_layout(results):
    r = results[0]
    path = os.path.join(r["root"], "csv", "run1", "Train_Samples_train_loss.csv")
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "train_loss"]
    assert [float(v) for _, v in rows[1:]] == pytest.approx(r["ref_losses"], rel=1e-5)


def test_only_rank_0_writes(results):
    assert all(results[0]["exists"].values())
    assert not any(results[1]["exists"].values())
    assert results[1]["printed"] == ""
    assert all(r["monitor_enabled"] for r in results)  # engine.monitor.enabled, on every rank


def test_log_line_shows_loss_time_and_throughput(results):
    r = results[0]
    lines = [line for line in r["printed"].splitlines() if re.match(r"\[zeroshard\] step \d", line)]
    assert [int(re.search(r"step (\d+)", line).group(1)) for line in lines] == [2, 4]
    for line, step in zip(lines, (2, 4)):
        loss = float(re.search(r"loss ([0-9.]+)", line).group(1))
        assert loss == pytest.approx(r["ref_losses"][step - 1], abs=1e-4)
        assert re.search(r"[0-9.]+ ms/step", line)
        rate = float(re.search(r"([0-9,]+) tokens/s", line).group(1).replace(",", ""))
        tflops = float(re.search(r"([0-9.e+-]+) TFLOPS/device", line).group(1))
        # Model FLOPs: 6 x the whole model's parameters per token, per device (of 2), although
        # stage 3 holds only shards of them.
        n_params = sum({id(p): p.numel() for p in make_model().parameters()}.values())
        assert tflops * 1e12 == pytest.approx(rate / 2 * 6 * n_params, rel=0.01)
        assert "MFU" not in line  # no known peak on a CPU
    breakdown = [line for line in r["printed"].splitlines() if "time (ms)" in line]
    assert len(breakdown) == 2 and all("fwd:" in b and "bwd:" in b and "step:" in b
                                       for b in breakdown)


def test_flops_profile_counts_the_profiled_step(results):
    r = results[0]
    with open(os.path.join(r["root"], "flops.txt")) as fh:
        text = fh.read()
    total = int(re.search(r"total: ([0-9,]+) FLOPs", text).group(1).replace(",", ""))
    # Stage 3 gathers and releases parameters; the arithmetic is plain torch's.
    assert total == r["ref_flops"] > 0
    assert f"flops profile of step {PROFILE_STEP}" in text
    assert re.search(r"^\s+block1\s", text, re.M) and re.search(r"^\s+block2\s", text, re.M)


# -- single process ---------------------------------------------------------------------------------
def _cfg(**sections):
    return load_config({"train_batch_size": 1, **sections})


@pytest.mark.parametrize("key,package", [("wandb", "wandb"), ("comet", "comet_ml")])
def test_missing_package_is_named_with_its_config_key(key, package):
    try:
        __import__(package)
        pytest.skip(f"{package} is installed")
    except ImportError:
        pass
    with pytest.raises(MissingPackageError, match=rf"'{key}.enabled'.*'{package}'.*pip install"):
        MonitorMaster(_cfg(**{key: {"enabled": True}}), rank=0)
    # Other ranks write nothing, so they need nothing.
    assert MonitorMaster(_cfg(**{key: {"enabled": True}}), rank=1).writers == []


def test_monitor_off_by_default_and_config_keys_checked():
    monitor = MonitorMaster(_cfg(), rank=0)
    assert not monitor.enabled and monitor.writers == []
    monitor.write_events([("Train/Samples/lr", 0.1, 8)])  # nothing to write to, no error
    with pytest.raises(ConfigError, match="output_path"):
        _cfg(tensorboard={"enabled": True, "output_pth": "x"})


def test_peak_flops_table_and_mfu(monkeypatch):
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert mfu(1000.0, 6e9, None) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, expected in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                           ("NVIDIA A100-SXM4-80GB", 312e12), ("Some Future GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_flops(torch.device("cuda", 0), torch.bfloat16) == expected
    # 1e4 tokens/s/device of a 1e9-parameter model is 6e13 FLOP/s: 6.1% of an H100's 989 TFLOPS.
    assert mfu(1e4, 6e9, 989e12) == pytest.approx(6e13 / 989e12)
