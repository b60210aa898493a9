"""A DeepSpeed tutorial script with `import zeroshard as deepspeed` runs unchanged under
`zeroshard script.py --deepspeed --deepspeed_config cfg.json` at 2 ranks, stages 0-3, and matches
a single-process reference; every DeepSpeed name it touches behaves (tests/dropin_script.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).parent))
import dropin_script  # noqa: E402

ROOT = Path(__file__).parent.parent
MICRO, CLIP, LR, WORLD = 4, 1.0, 0.01, 2


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _reference() -> dict[str, torch.Tensor]:
    """The same steps in one process: each global batch is the union of the ranks' batches."""
    torch.manual_seed(0)
    model = dropin_script.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = dropin_script.dataset()
    steps = 0
    for epoch in range(10):
        batches = []
        for rank in range(WORLD):
            sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank)
            sampler.set_epoch(epoch)
            idx = list(sampler)
            batches.append([idx[i:i + MICRO] for i in range(0, len(idx), MICRO)])
        for per_rank in zip(*batches):
            opt.zero_grad()
            loss = sum(F.mse_loss(model(data[i][0]), data[i][1]) for i in per_rank) / WORLD
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            steps += 1
            if steps == dropin_script.STEPS:
                return {n: p.detach() for n, p in model.named_parameters()}
    raise AssertionError("dataset too small for the steps")


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tutorial_script_runs_unchanged(stage, reference, tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(_config(stage)))
    env = dict(os.environ, ZEROSHARD_QUIET="1", PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-m", "zeroshard.cli", str(ROOT / "tests" / "dropin_script.py"),
                          "--deepspeed", "--deepspeed_config", str(cfg), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"stage {stage}: checks failed: {failed}"
    if stage == 3:
        assert "ds_attrs" in result["checks"]
    assert result["stage"] == stage
    for name, ref in reference.items():
        got = torch.tensor(result["weights"][name])
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"stage {stage} {name}: relative error {err:.2e}"
