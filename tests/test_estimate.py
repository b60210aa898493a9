"""The estimator reproduces the ZeRO paper's Table 1 and the seed table, agrees with the measured
memory ledger for every stage and offload placement at world sizes 1-4, and `zeroshard plan`
picks the cheapest configuration that fits."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.cli import main as cli_main
from zeroshard.estimate import GB, Shape, estimate, model_states
from zeroshard.sizing.plan import plan
from tests.harness import run_world
from tests.models import lm_loss, make_batches, make_model, micro_slice

ROOT = Path(__file__).parent.parent

# ZeRO paper (Rajbhandari et al., 2020), Table 1: GB per device for P_os, P_os+g, P_os+g+p,
# mixed-precision Adam (K = 12), at data-parallel degrees 1, 4, 16, 64, 256, 1024.
TABLE1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"),
            1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"),
           16: ("4750", "2875", "1000"), 64: ("4187", "2218", "250"),
           256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}


def _within_rounding(value: float, printed: str) -> bool:
    """The paper rounds (and for large values truncates) to the digits it prints."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(value - float(printed)) < 10 ** -decimals


@pytest.mark.parametrize("params", TABLE1, ids=lambda p: f"{p:.3g}")
def test_paper_table1(params):
    for n, expected in TABLE1[params].items():
        est = estimate(params, gpus=n)
        assert est.row(0).on("device") / GB == pytest.approx(16 * params / GB)
        for stage, printed in zip((1, 2, 3), expected):
            got = est.row(stage).on("device") / GB
            assert _within_rounding(got, printed), (params, n, stage, got, printed)


def test_seed_table_fp32_one_billion_on_four_gpus():
    # Seed: "1B parameters, fp32, 4 GPUs: 16 / 10 / 7 / 4 GB" (K = 8: Adam's two fp32 moments).
    est = estimate("1B", gpus=4, precision="fp32")
    assert [est.row(s).on("device") / GB for s in range(4)] == [16, 10, 7, 4]


def test_seven_billion_is_112_gb_in_plain_data_parallelism():
    # 16 bytes per parameter: the seed's "7B: 16GB" row is really the per-billion figure.
    assert estimate("7B").row(0).on("device") == 16 * 7e9 == 112 * GB


def test_comm_and_offload_traffic():
    est = estimate(1e9, gpus=4, offload_optimizer="cpu")
    for stage in range(3):
        assert est.row(stage).comm_bytes == 2 * 2 * 1e9 * 3 / 4
    assert est.row(3).comm_bytes == 3 * 2 * 1e9 * 3 / 4
    row = est.row(2, "cpu")
    assert row.offload_traffic == 4 * 1e9 / 4  # ZeRO-Offload: 4 Psi bytes in fp16, per shard
    assert row.on("device") == 2e9 and row.on("cpu") == (12 + 2) * 1e9 / 4


def test_buffers_are_separate_and_checkpointing_shrinks_activations():
    shape = Shape(hidden=1024, layers=24, seq=1024, micro_batch=2)
    row = estimate(350e6, gpus=8, shape=shape).row(3)
    assert {"comm buckets", "gathered units", "activations", "activations (AC)"} <= set(row.buffers)
    assert row.buffers["activations (AC)"] < row.buffers["activations"] / 4
    assert row.buffers["gathered units"] == 2 * 12 * 1024 ** 2 * 2  # two blocks, bf16


# -- estimate vs the memory ledger ---------------------------------------------------------------

LEAN3 = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
         "stage3_prefetch_bucket_size": 0}
PLACEMENTS = [(s, "none", "none") for s in range(4)] + \
    [(s, o, "none") for s in (1, 2, 3) for o in ("cpu", "nvme")] + \
    [(3, "none", "cpu"), (3, "none", "nvme"), (3, "nvme", "nvme")]


def _measure(rank, world, root):
    out = {}
    for precision in ("fp32", "bf16"):
        for stage, opt, par in PLACEMENTS:
            zero = {"stage": stage, "reduce_bucket_size": 200, **(LEAN3 if stage == 3 else {})}
            if opt != "none":
                zero["offload_optimizer"] = {"device": opt, "nvme_path": root}
            if par != "none":
                zero["offload_param"] = {"device": par, "nvme_path": root}
            model = make_model()
            psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            engine, _, _, _ = zeroshard.initialize(
                model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": precision == "bf16"},
                        "zero_optimization": zero})
            tokens, targets = micro_slice(make_batches(1, 2 * world)[0], 0, rank, world, 2)
            engine.backward(lm_loss(engine(tokens), targets))
            engine.step()
            files = sum(1 for _, _, fs in os.walk(root) for f in fs if f.endswith(".swp"))
            out[(precision, stage, opt, par)] = (psi, len(engine.optimizer.units), files,
                                                 engine.memory_report())
            engine.destroy()
    return out


@pytest.fixture(scope="module", params=(1, 2, 3, 4), ids=lambda n: f"world{n}")
def measured(request, tmp_path_factory):
    """Rank 0's ledgers after one step, every placement, at one world size."""
    root = str(tmp_path_factory.mktemp("nvme"))
    return request.param, run_world(request.param, _measure, root)[0]


def test_estimate_equals_ledger_up_to_padding(measured):
    world, results = measured
    largest = 0
    for (precision, stage, opt, par), (psi, units, files, report) in results.items():
        expected = model_states(psi, world, stage, precision, "adam", opt, par)
        for kind in ("params", "grads", "optimizer"):
            elem = 4 if kind == "optimizer" or precision == "fp32" else 2
            # Each unit pads by < 16 N elements per shard (3 tensors per unit for Adam state),
            # swap files round up to 4 KiB, and Adam keeps a 4-byte step counter per unit.
            slack = units * 16 * world * elem * 3 + files * 4096 + units * 8
            for place in ("device", "cpu", "nvme"):
                diff = report[kind][place] - expected[kind][place]
                largest = max(largest, abs(diff))
                assert abs(diff) <= slack, (precision, stage, opt, par, kind, place,
                                            report[kind][place], expected[kind][place])
    print(f"world {world}: largest estimate-vs-ledger difference {largest:.0f} bytes")


# -- plan ---------------------------------------------------------------------------------------

def test_plan_picks_stage_0_when_everything_fits():
    result = plan("125M", gpu_mem=80 * GB, gpus=8)
    assert result.choice.row.stage == 0 and not result.rejected
    assert result.config["zero_optimization"]["stage"] == 0


def test_plan_picks_stage_1_when_plain_dp_does_not_fit():
    result = plan("2B", gpu_mem=32 * GB, gpus=8)  # states: 32 GB at stage 0, 11 GB at stage 1
    assert result.choice.row.stage == 1
    assert [v.row.stage for v in result.rejected] == [0]
    assert "needs 32 GB per GPU" in result.rejected[0].reasons[0]


def test_plan_picks_stage_3_with_offload_when_only_that_fits():
    result = plan("7B", gpu_mem=16 * GB, gpus=1, cpu_mem=256 * GB, nvme_free=2000 * GB)
    choice = result.choice.row
    assert choice.stage == 3 and choice.offload_param != "none"
    zero = result.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == choice.offload_param
    # Every cheaper candidate was tried and said why not.
    assert len(result.rejected) >= 5 and all(v.reasons for v in result.rejected)


def test_plan_refuses_when_nothing_fits():
    result = plan("1T", gpu_mem=24 * GB, gpus=1, cpu_mem=64 * GB, nvme_free=100 * GB)
    assert result.choice is None and result.config is None
    assert "nothing fits" in result.report()


def test_plan_config_loads_and_cli_writes_it(tmp_path):
    out = tmp_path / "plan.json"
    res = _cli("plan", "--params", "7B", "--gpus", "1", "--gpu-mem", "24GB", "--cpu-mem", "256GB",
               "--nvme-free", "2TB", "--out", str(out))
    assert res.returncode == 0, res.stderr
    config = json.loads(out.read_text())
    zeroshard.load_config(config, world_size=1)  # the recommendation is a valid config
    again = _cli("plan", "--params", "7B", "--gpu-mem", "24GB", "--cpu-mem", "256GB",
                 "--nvme-free", "2TB", "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr


# -- CLI -----------------------------------------------------------------------------------------

def _cli(*args):
    """`zeroshard ARGS` run in this process (the console script itself: _console_script)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([*args])
    return subprocess.CompletedProcess(["zeroshard", *args], code, out.getvalue(), err.getvalue())


def test_cli_estimate_prints_the_paper_row():
    res = _cli("estimate", "--params", "7.5e9", "--gpus", "64")
    assert res.returncode == 0, res.stderr
    row = {line.split("|")[1].strip(): line.split("|")[5].strip()
           for line in res.stdout.splitlines() if line.startswith("| ") and "---" not in line}
    assert (row["baseline DP"], row["stage 1"], row["stage 2"], row["stage 3"]) == \
        ("120", "31.4", "16.6", "1.88")
    assert "GB = 10^9 bytes" in res.stdout


def test_cli_estimate_from_a_model_factory():
    res = _cli("estimate", "--model", "tests.models:TinyLM", "--gpus", "2", "--json")
    assert res.returncode == 0, res.stderr
    model = make_model()
    psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert json.loads(res.stdout)["params"] == psi


def _console_script(*args, cwd):
    """The installed `zeroshard` command (unlike `python -m`, it does not put cwd on sys.path)."""
    exe = os.path.join(os.path.dirname(sys.executable), "zeroshard")
    command = [exe] if os.path.exists(exe) else [sys.executable, "-m", "zeroshard.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_cli_estimate_imports_a_model_module_from_the_current_directory(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(10, 3)\n")
    res = _console_script("estimate", "--model", "mymodels:build", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["params"] == 10 * 3 + 3


def test_plan_without_out_says_where_it_wrote(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = _cli("plan", "--params", "1B", "--gpus", "8", "--gpu-mem", "80GB")
    assert res.returncode == 0, res.stderr
    written = tmp_path / "ds_config.plan.json"
    assert written.is_file()
    assert f"config written to {written}" in res.stdout and "--out" in res.stdout


@pytest.mark.parametrize("args, message", [
    (("--params", "-1"), "must be a positive number"),
    (("--params", "lots"), "give a count such as 7.5e9"),
    (("--params", "1B", "--gpus", "0"), "--gpus: 0: must be at least 1"),
    (("--model", "no_such_pkg.models:build"), "cannot import module 'no_such_pkg.models'"),
    (("--model", "tests.models:nothing_here"), "has no callable 'nothing_here'"),
])
def test_cli_estimate_bad_arguments(args, message):
    res = _cli("estimate", *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
