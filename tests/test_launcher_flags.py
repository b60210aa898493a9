"""DeepSpeed's launcher flags on `zeroshard run`, each mapped onto torchrun (checked in-process,
plus the core-binding wrapper run for real), and `import deepspeed` resolving to zeroshard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.cli import launch
from zeroshard.compat.deepspeed import launcher_flags as deepspeed_flags
from zeroshard.cli.bind import parse_cores

ROOT = Path(__file__).parent.parent
CPU_ONLY = not torch.cuda.is_available()
MACRO = "${local_rank}"


def _script(tmp_path, body="import argparse\n", name="train.py") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def _usage_error(argv) -> str:
    with pytest.raises(launch.UsageError) as info:
        launch.prepare_run_args(argv)
    return str(info.value)


# -- local rank --------------------------------------------------------------------------------

def test_deepspeed_scripts_get_local_rank_the_way_deepspeed_passes_it(tmp_path):
    """HelloDeepSpeed takes local_rank through fire (no '--local_rank' string in its source):
    a script that imports deepspeed gets --local_rank=<n> first, as DeepSpeed's launcher does."""
    fire_style = _script(tmp_path, "import deepspeed\nimport fire\n"
                                   "def train(local_rank: int = -1, steps: int = 2): ...\n"
                                   "fire.Fire(train)\n")
    args = launch.prepare_run_args([fire_style, "--steps", "3"])
    assert args.training_script_args == [f"--local_rank={MACRO}", "--steps", "3"]
    for line in ("from deepspeed.accelerator import get_accelerator", "import zeroshard as deepspeed"):
        path = _script(tmp_path, line + "\n", name="other.py")
        assert launch.prepare_run_args([path]).training_script_args == [f"--local_rank={MACRO}"]
    assert launch.prepare_run_args(["--no_local_rank", fire_style]).training_script_args == []
    plain = _script(tmp_path, "import zeroshard\n", name="plain.py")
    assert launch.prepare_run_args([plain]).training_script_args == []


# -- devices and nodes -------------------------------------------------------------------------

@pytest.mark.skipif(not CPU_ONLY, reason="device counts differ on a GPU machine")
def test_include_exclude_choose_this_nodes_devices(tmp_path):
    script = _script(tmp_path)
    args = launch.prepare_run_args(["--include", "localhost:1,3", script])
    assert (args.nproc_per_node, args.zeroshard_env["CUDA_VISIBLE_DEVICES"]) == ("2", "1,3")
    args = launch.prepare_run_args(["-i", "localhost", script])
    assert args.nproc_per_node == "2"  # the whole host: its default rank count on a CPU host
    args = launch.prepare_run_args(["--exclude=localhost:0", script])
    assert (args.nproc_per_node, args.zeroshard_env["CUDA_VISIBLE_DEVICES"]) == ("1", "1")
    assert "names host 'worker-2'" in _usage_error(["--include", "worker-2:0", script])
    assert "cannot be combined" in _usage_error(["--include", "localhost:0", "--exclude",
                                                 "localhost:1", script])
    assert "--num_gpus/--nproc-per-node cannot be combined" in _usage_error(
        ["--num_gpus", "2", "--include", "localhost:0", script])
    assert "leaves no device" in _usage_error(["--exclude", "localhost", script])


def test_deepspeed_spellings_map_onto_torchrun(tmp_path):
    script = _script(tmp_path)
    args = launch.prepare_run_args(["--num_accelerators", "3", "--master_addr", "10.0.0.1",
                                    "--master_port", "29600", "--node_rank", "0",
                                    "--enable_each_rank_log", str(tmp_path / "logs"), script])
    assert (args.nproc_per_node, args.master_addr, args.master_port) == ("3", "10.0.0.1", 29600)
    assert not args.standalone  # the user chose the rendezvous
    assert (args.log_dir, args.redirects) == (str(tmp_path / "logs"), "3")
    # The node-level variables DeepSpeed's launcher sets too.
    assert {k: args.zeroshard_env[k] for k in ("LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")} == \
        {"LOCAL_SIZE": "3", "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    args = launch.prepare_run_args(["--no_ssh_check", "--log_level", "info", "-q", script])
    assert args.standalone
    message = _usage_error(["--launcher", "openmpi", script])
    assert "--launcher is a DeepSpeed launcher option" in message and "each node" in message


def test_hostfile(tmp_path):
    """One local host: its slots are the rank count. Several hosts: DeepSpeed's no-ssh mode maps
    onto torchrun's static rendezvous; without it, an error showing torchrun and Slurm lines."""
    script = _script(tmp_path)
    local = tmp_path / "local"
    local.write_text("# this machine\nlocalhost slots=3\n")
    assert launch.prepare_run_args(["--hostfile", str(local), script]).nproc_per_node == "3"
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-1 slots=4\nworker-2 slots=2\n")
    message = _usage_error(["--hostfile", str(hosts), script])
    assert "does not ssh" in message and "torchrun --nnodes 2" in message and "srun" in message
    args = launch.prepare_run_args(["--hostfile", str(hosts), "--no_ssh", "--node_rank", "1",
                                    "--master_addr", "worker-1", "--master_port", "29500", script])
    assert (args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr) == \
        ("2", 1, "2", "worker-1")
    assert "needs --node_rank" in _usage_error(["-H", str(hosts), "--no_ssh", script])
    args = launch.prepare_run_args(["-H", str(hosts), "--num_nodes", "1", "--no_ssh",
                                    "--node_rank", "0", "--master_addr", "w1", script])
    assert (args.nnodes, args.nproc_per_node) == ("1", "4")  # DeepSpeed's --num_nodes: first N
    bad = tmp_path / "bad"
    bad.write_text("worker-1 4\n")
    assert "line 1: expected 'hostname slots=N'" in _usage_error(["-H", str(bad), script])


# -- core binding ------------------------------------------------------------------------------

def test_bind_cores_wraps_each_worker(tmp_path):
    script = _script(tmp_path)
    args = launch.prepare_run_args(["--nproc-per-node", "2", "--bind_core_list", "0,2-3,5",
                                    script, "--x"])
    assert args.no_python and not args.module and args.training_script == sys.executable
    assert args.training_script_args == ["-u", str(launch.BIND), "0,2;3,5", MACRO, "--",
                                         sys.executable, "-u", script, "--x"]
    assert deepspeed_flags.core_assignment("0-7", 3) == "0,1;2,3;4,5"
    assert parse_cores("1,3-5,7") == [1, 3, 4, 5, 7]
    assert "each rank needs at least one" in _usage_error(
        ["--nproc-per-node", "4", "--bind_core_list", "0-2", script])


def test_bind_wrapper_pins_the_process_and_sets_omp_threads():
    """bind.py for local rank 1 of "0;<cpu>": the command it execs sees one CPU and OMP=1."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    res = subprocess.run([sys.executable, str(launch.BIND), f"0;{cpu}", "1", "--", sys.executable,
                          "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [f"[{cpu}]", "1"]


# -- import deepspeed --------------------------------------------------------------------------

def test_alias_is_on_for_workers_only_and_switchable(tmp_path):
    script = _script(tmp_path, "import deepspeed\n")
    env = launch.prepare_run_args([script]).zeroshard_env
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launch.SHIM)
    assert "PYTHONPATH" not in launch.prepare_run_args(["--no-alias-deepspeed", script]).zeroshard_env
    assert "contradict" in _usage_error(["--alias-deepspeed", "--no-alias-deepspeed", script])
    assert str(launch.SHIM) not in os.environ.get("PYTHONPATH", "")  # this process unchanged


_ALIAS_CHECKS = """
import json, sys
import deepspeed, zeroshard
from deepspeed.accelerator import get_accelerator
from deepspeed import get_accelerator as top_level
import deepspeed.comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as moe_split
import deepspeed.pipe
import importlib.metadata as metadata
from transformers.integrations.deepspeed import is_deepspeed_available
from accelerate.utils import is_deepspeed_available as accelerate_sees
from zeroshard.compat.deepspeed.alias import DEEPSPEED_VERSION
out = {"initialize": deepspeed.initialize is zeroshard.initialize,
       "accelerator": get_accelerator() is zeroshard.get_accelerator() and top_level is get_accelerator,
       "comm": dist.get_rank is zeroshard.comm.get_rank,
       "zero": ZeroParamStatus is zeroshard.zero.ZeroParamStatus,
       "engine": deepspeed.DeepSpeedEngine is zeroshard.Engine,
       "isinstance": isinstance(object(), deepspeed.pipe.PipelineModule),
       "hf_and_accelerate_see_deepspeed": is_deepspeed_available() and accelerate_sees(),
       "version": [metadata.version("deepspeed"), metadata.metadata("deepspeed")["Name"],
                   deepspeed.__version__, DEEPSPEED_VERSION],
       "logger": type(deepspeed.utils.logger).__name__}
import torch
expert = torch.nn.Parameter(torch.zeros(1))
expert.allreduce = False  # DeepSpeed's mark of an expert's parameter
for name, use in (("moe", lambda: moe_split({"params": [expert]})),
                  ("pipe", lambda: deepspeed.pipe.PipelineModule([])),
                  ("inference", lambda: deepspeed.init_inference(None))):
    try:
        use()
        out[name] = "no error"
    except NotImplementedError as err:
        out[name] = str(err)
json.dump(out, sys.stdout)
"""


def test_import_deepspeed_resolves_to_zeroshard_with_the_shim():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(launch.SHIM), str(ROOT / "src")]))
    res = subprocess.run([sys.executable, "-c", _ALIAS_CHECKS], capture_output=True, text=True,
                         timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    for key in ("initialize", "accelerator", "comm", "zero", "engine",
                "hf_and_accelerate_see_deepspeed"):
        assert out[key] is True, key
    # The shim's package metadata answers for transformers', accelerate's and TRL's checks, with
    # a version that says whose DeepSpeed this is; the dist-info folder carries the same one.
    installed, name, attribute, ours = out["version"]
    assert installed == attribute == ours and ours.endswith("+zeroshard") and name == "deepspeed"
    assert (launch.SHIM / f"deepspeed-{ours}.dist-info" / "METADATA").is_file()
    assert out["logger"] == "Logger"
    assert out["isinstance"] is False
    # Groups without experts pass through (tests/test_deepspeed_api.py); an expert is refused.
    assert out["moe"].startswith("parameter group 0 ('unnamed') holds expert parameters"), out["moe"]
    assert out["pipe"].startswith("deepspeed.pipe.PipelineModule is not supported by zeroshard "
                                  "(pipeline parallelism)")
    assert "deepspeed.init_inference is not supported" in out["inference"]


def test_outside_the_launcher_import_deepspeed_still_fails():
    """`python script.py` keeps needing the import changed (the README says so)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-c", "import zeroshard, deepspeed"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 1 and "No module named 'deepspeed'" in res.stderr
