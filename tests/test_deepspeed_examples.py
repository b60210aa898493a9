"""A DeepSpeed-examples-style script with `import deepspeed` and
`from deepspeed.accelerator import get_accelerator` left as they are (tests/ds_example_script.py)
runs under `zeroshard run` with DeepSpeed's launcher flags at 2 ranks, stages 1-3, and ends with
the weights of a single-process reference."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
import ds_example_model as m  # noqa: E402
from zeroshard.compat.deepspeed.launcher_flags import _physical_cores  # noqa: E402

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "tests" / "ds_example_script.py"
WORLD = 2
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < WORLD,
                                reason="two ranks need two GPUs where CUDA is available")


def _reference() -> dict[str, torch.Tensor]:
    """The same steps in one process: each global batch is the union of the ranks' batches
    (DistributedSampler order of epoch 0, as the engine's loader without set_epoch)."""
    torch.manual_seed(0)
    model = m.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=m.LR, betas=m.BETAS, eps=m.EPS,
                            weight_decay=m.WEIGHT_DECAY)
    data = m.dataset()
    per_rank = [list(DistributedSampler(data, num_replicas=WORLD, rank=r)) for r in range(WORLD)]
    for step in range(m.STEPS):
        idx = [i for r in range(WORLD) for i in per_rank[r][step * m.MICRO:(step + 1) * m.MICRO]]
        x, y = data[idx]
        opt.zero_grad()
        # Mean over each rank's micro batch, averaged over ranks (equal sizes: the global mean).
        torch.nn.functional.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.CLIP)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bind_flags() -> list[str]:
    """--bind_cores_to_rank when each rank can have a physical core, else an explicit list."""
    if len(_physical_cores()) >= WORLD:
        return ["--bind_cores_to_rank"]
    cpus = sorted(os.sched_getaffinity(0))
    return ["--bind_core_list", ",".join(map(str, cpus))] if len(cpus) >= WORLD else []


LAUNCHES = {
    1: lambda: ["run", *_bind_flags(), "--num_gpus", str(WORLD)],
    2: lambda: ["run", "--include", "localhost:0,1"],
    3: lambda: ["--num_nodes", "1", "--num_gpus", str(WORLD), "--master_addr", "127.0.0.1",
                "--master_port", str(_free_port())],
}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_examples_style_script_runs_unchanged(stage, reference, tmp_path):
    launcher = LAUNCHES[stage]()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env.update(ZEROSHARD_QUIET="1", PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-m", "zeroshard.cli", *launcher, str(SCRIPT),
                          f"--stage={stage}", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "fp16_master_weights_and_grads" not in res.stderr  # fp16 is off: nothing to say
    result = json.loads((tmp_path / "result.json").read_text())
    ranks = result["ranks"]
    assert [r["env_local_rank"] for r in ranks] == [0, 1]
    for seen in ranks:
        # --local_rank=<n> reached train(local_rank=...) through the fire-style command line.
        assert seen["local_rank"] == seen["env_local_rank"]
        assert (seen["world"], seen["stage"], seen["resumed"]) == (WORLD, stage, True)
        if not torch.cuda.is_available():
            assert (seen["name"], seen["backend"], seen["current"]) == ("cpu", "gloo", "cpu")
            assert seen["device"] == f"cpu:{seen['local_rank']}" and seen["device_count"] == WORLD
        assert seen["memory"] and seen["total_memory"] and seen["elapsed_ms"]
        assert seen["moe_plain"]
        assert "parameter group 0 ('e') holds expert parameters (allreduce=False)" in seen["moe"]
        assert "zeroshard has no mixture of experts" in seen["moe"]
    if stage == 1 and "--bind_cores_to_rank" in launcher + ["--bind_core_list"]:
        pinned = [set(r["affinity"]) for r in ranks]
        assert pinned[0] and pinned[1] and not pinned[0] & pinned[1]  # each rank its own cores
        assert [int(r["omp"]) for r in ranks] == [len(p) for p in pinned]
    if stage == 2:
        assert [r["visible"] for r in ranks] == ["0,1", "0,1"]
    for name, ref in reference.items():
        got = torch.tensor(result["weights"][name])
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"stage {stage} {name}: relative error {err:.2e}"
