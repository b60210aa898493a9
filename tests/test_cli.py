"""The `zeroshard` command: `run` / script shorthand through torchrun, `demo` end to end, errors.

Launching ranks costs seconds on 2 cores, so each real launch checks several things at once; the
argument handling (defaults, DeepSpeed spellings, --local_rank) is also checked in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from zeroshard import cli
from zeroshard.cli import launch

LAUNCH_TIMEOUT = 300
DEFAULT_NPROC = torch.cuda.device_count() if torch.cuda.is_available() else 2

# Writes what this rank saw to <out>/rank<R>.json, after a real process-group start.
_REPORTER = """\
import json, os, sys
import torch.distributed as dist
import zeroshard
{declare}
zeroshard.init_distributed()
out = os.environ["ZS_TEST_OUT"]
with open(os.path.join(out, f"rank{{dist.get_rank()}}.json"), "w") as fh:
    json.dump({{"rank": dist.get_rank(), "world": dist.get_world_size(),
               "local_rank": os.environ["LOCAL_RANK"], "argv": sys.argv[1:]}}, fh)
dist.barrier()
dist.destroy_process_group()
"""

_DECLARES = {
    "none": "",
    "underscore": "import argparse\n"
                  "p = argparse.ArgumentParser(); p.add_argument('--local_rank', type=int)\n"
                  "p.add_argument('--foo'); p.parse_args()",
    "dash": "import argparse\n"
            "p = argparse.ArgumentParser(); p.add_argument(\"--local-rank\", type=int)",
}


def _zeroshard(*args: str, env: dict | None = None, timeout: float = LAUNCH_TIMEOUT):
    return subprocess.run([sys.executable, "-m", "zeroshard.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _write_script(tmp_path, declare: str) -> str:
    path = tmp_path / f"report_{declare}.py"
    path.write_text(_REPORTER.format(declare=_DECLARES[declare]))
    return str(path)


def _reports(out_dir) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


# ------------------------------------------------------------------------------- real launches


def test_run_passes_args_and_no_local_rank_when_undeclared(tmp_path):
    """`zeroshard run` starts 2 real ranks that get the script's args and no --local_rank."""
    script = _write_script(tmp_path, "none")
    res = _zeroshard("run", "--nproc-per-node", "2", script, "--foo", "1",
                     env={"ZS_TEST_OUT": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    reports = _reports(tmp_path)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["world"] == 2
        assert r["argv"] == ["--foo", "1"]  # never a --local_rank the script did not declare


def test_script_shorthand_passes_declared_local_rank(tmp_path):
    """`zeroshard script.py` == `run`; a script declaring --local_rank receives it per rank."""
    script = _write_script(tmp_path, "underscore")
    res = _zeroshard(script, "--foo", "1", env={"ZS_TEST_OUT": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    reports = _reports(tmp_path)
    assert len(reports) == DEFAULT_NPROC
    for r in reports:
        assert r["world"] == DEFAULT_NPROC
        assert r["argv"] == [f"--local_rank={r['local_rank']}", "--foo", "1"]


def _parse_demo_table(stdout: str) -> dict[str, dict[str, float]]:
    rows = {}
    number = r"[ \t]+([0-9.]+)"
    pattern = re.compile(r"^(\S+)" + number * 7 + r"[ \t]+([0-9.]+x|all off)", re.MULTILINE)
    for m in pattern.finditer(stdout):
        loss, ms, params, grads, optim, total, device = map(float, m.groups()[1:8])
        rows[m.group(1)] = dict(loss=loss, ms=ms, params=params, grads=grads, optim=optim,
                                total=total, device=device)
    return rows


def test_demo_end_to_end():
    """`zeroshard demo --steps 3`: a row per stage, ZeRO savings measured, losses agree."""
    res = _zeroshard("demo", "--steps", "3")
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    rows = _parse_demo_table(out)
    assert set(rows) == {"0", "1", "2", "3", "2+cpu", "3+nvme"}, out
    assert rows["1"]["optim"] < rows["0"]["optim"]
    assert rows["2"]["grads"] < rows["1"]["grads"]
    assert rows["3"]["params"] < rows["2"]["params"]
    assert rows["3"]["total"] < rows["2"]["total"] < rows["1"]["total"] < rows["0"]["total"]
    for name in "0123":  # without offload everything is on the device
        assert rows[name]["device"] == rows[name]["total"]
    # Offload keeps the model states but moves them off the device.
    # (gradient shards go with the optimizer to CPU memory; parameters too at 3+nvme).
    assert rows["2+cpu"]["device"] == pytest.approx(rows["2"]["params"], abs=0.002)
    assert rows["3+nvme"]["device"] == 0
    agree = [line for line in out.splitlines() if line.startswith("losses ")]
    assert len(agree) == 1 and agree[0].startswith("losses agree"), out
    estimate = [line for line in out.splitlines() if line.startswith("estimate ")]
    assert len(estimate) == 1 and "largest difference" in estimate[0], out
    # Every GPU when there are some, else 2 CPU ranks.
    ranks = torch.cuda.device_count() if torch.cuda.is_available() else 2
    assert f"{ranks} ranks" in out.splitlines()[0], out.splitlines()[0]


def test_missing_script_is_one_line_exit_2(tmp_path):
    """A missing script is one error line naming it and exit code 2, no traceback."""
    missing = str(tmp_path / "no_such_train.py")
    res = _zeroshard(missing, "--foo", "1", timeout=120)
    assert res.returncode == 2
    assert missing in res.stderr
    assert "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


# -------------------------------------------------------------------------------- in-process


def test_run_defaults_nproc_and_standalone(tmp_path, monkeypatch):
    """Without options: 2 ranks on CPU (all GPUs with CUDA) and a standalone rendezvous."""
    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    script = _write_script(tmp_path, "none")
    args = launch.prepare_run_args([script])
    assert args.nproc_per_node == str(DEFAULT_NPROC)
    assert args.standalone  # free port, no collision between two jobs on one machine
    assert args.training_script_args == []


def test_run_keeps_user_rendezvous(tmp_path):
    """Rendezvous / master / multi-node options are left to torchrun untouched."""
    script = _write_script(tmp_path, "none")
    args = launch.prepare_run_args(["--nproc_per_node", "3", "--master-port", "29555", script])
    assert args.nproc_per_node == "3" and not args.standalone and args.master_port == 29555
    args = launch.prepare_run_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", script])
    assert not args.standalone and args.rdzv_endpoint == "h:1"
    args = launch.prepare_run_args(["--nnodes", "2", script])
    assert not args.standalone


def test_deepspeed_launcher_spellings(tmp_path):
    """--num_gpus / --num_nodes map to torchrun's --nproc-per-node / --nnodes."""
    script = _write_script(tmp_path, "none")
    args = launch.prepare_run_args(["--num_gpus", "4", "--num_nodes", "1", script, "--x"])
    assert args.nproc_per_node == "4" and args.nnodes == "1"
    assert args.training_script_args == ["--x"]
    assert "--num_gpus" in launch.build_run_parser().format_help()


def test_local_rank_follows_declared_spelling(tmp_path):
    """--local_rank / --local-rank is added in the declared spelling, once, unless disabled."""
    from torch.distributed.elastic.utils.api import macros

    under = _write_script(tmp_path, "underscore")
    dash = _write_script(tmp_path, "dash")
    assert launch.prepare_run_args([under, "--a"]).training_script_args == [
        f"--local_rank={macros.local_rank}", "--a"]
    assert launch.prepare_run_args([dash]).training_script_args == [
        f"--local-rank={macros.local_rank}"]
    # Given explicitly, or turned off: not added.
    given = launch.prepare_run_args([under, "--local_rank=7"])
    assert given.training_script_args == ["--local_rank=7"]
    assert launch.prepare_run_args(["--no_local_rank", under]).training_script_args == []


def test_module_mode_and_missing_module(capsys):
    """`-m module` is accepted; an unknown module is a usage error naming it."""
    args = launch.prepare_run_args(["-m", "zeroshard.cli.demo", "--worker"])
    assert args.module and args.training_script_args == ["--worker"]
    assert cli.main(["run", "-m", "zeroshard.no_such_module"]) == 2
    assert "zeroshard.no_such_module" in capsys.readouterr().err


def test_estimate_and_plan_are_commands(capsys):
    """estimate and plan need a model: without one, a usage error naming the options (exit 2)."""
    assert cli.main(["estimate"]) == 2
    assert "one of the arguments --params --model is required" in capsys.readouterr().err
    assert cli.main(["plan", "--params", "1B"]) == 2
    assert "required: --gpu-mem" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "1B"]) == 0
    assert "| stage 3 |" in capsys.readouterr().out


def test_help_describes_every_demo_variant(capsys):
    """The top-level help names what the demo really runs: stages 0-3 and both offload tiers."""
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    demo_line = next(line for line in out.splitlines() if line.strip().startswith("demo"))
    assert "0-3" in demo_line and "CPU" in demo_line and "NVMe" in out


def test_version_and_demo_usage_errors(capsys):
    """--version prints the version; an unknown demo stage is a usage error."""
    assert cli.main(["--version"]) == 0
    assert "zeroshard 0.1.0" in capsys.readouterr().out
    assert cli.main(["demo", "--stages", "0,9"]) == 2
    assert "unknown stage 9" in capsys.readouterr().err


def test_demo_pieces_are_deterministic():
    """Corpus, batches and model of the demo are deterministic and of the intended size."""
    from zeroshard.cli import demo

    text = demo.load_corpus()
    assert len(text) == demo.CORPUS_CHARS and text == demo.load_corpus()
    data = demo.encode(text)
    assert int(data.max()) < demo.GPTConfig().vocab_size
    x0, y0 = demo.batch_for_step(data, 3, 0, 2, 4, 16, seed=1)
    x1, _ = demo.batch_for_step(data, 3, 1, 2, 4, 16, seed=1)
    assert torch.equal(x0, demo.batch_for_step(data, 3, 0, 2, 4, 16, seed=1)[0])
    assert not torch.equal(x0, x1) and torch.equal(x0[:, 1:], y0[:, :-1])
    model = demo.TinyGPT(demo.GPTConfig())
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 3e6
    assert model(x0).shape == (4, 16, demo.GPTConfig().vocab_size)
    assert set(demo.VARIANTS) >= {"0", "1", "2"}
    assert "losses agree" in demo.loss_agreement(
        [demo.VariantResult("0", losses=[1.0]), demo.VariantResult("1", losses=[1.0 + 1e-7])])
    assert "DISAGREE" in demo.loss_agreement(
        [demo.VariantResult("0", losses=[1.0]), demo.VariantResult("1", losses=[1.1])])
