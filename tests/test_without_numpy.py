"""zeroshard's own byte paths do not go through NumPy: NVMe swap files, `save_16bit_model` and
`zeroshard consolidate` work with NumPy unimportable, and the safetensors files they write are read
back exactly by the `safetensors` package. (NumPy is still a declared dependency: torch's object
collectives, which DCP uses to save a checkpoint, need it.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from zeroshard.checkpoint.safetensors_file import write_safetensors

# A world of one in a fresh interpreter. With "blocked", `import numpy` fails, as if it were not
# installed; the checkpoint is saved in an unblocked run (torch decides at import whether it has
# NumPy) and only consolidated in the blocked one.
SCRIPT = textwrap.dedent("""
    import json, os, sys
    blocked = sys.argv[2] == "blocked"
    if blocked:
        sys.modules["numpy"] = None  # any import of numpy now raises ImportError
    import torch
    import zeroshard
    from zeroshard.consolidate import consolidate

    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    nvme = {"device": "nvme", "nvme_path": os.path.join(out, "swap")}
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True,
                                    "offload_optimizer": nvme, "offload_param": nvme}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 8)).float().square().mean())
        engine.step()
    state = {k: v.float().tolist() for k, v in engine.consolidated_state_dict().items()}
    if blocked:
        engine.save_16bit_model(os.path.join(out, "weights"), "model.safetensors")
        files = consolidate(os.path.join(out, "ckpt"), os.path.join(out, "consolidated"))
    else:
        engine.save_checkpoint(os.path.join(out, "ckpt"))
        files = []
    engine.destroy()
    with open(os.path.join(out, sys.argv[2] + ".json"), "w") as fh:
        json.dump({"state": state, "files": files, "numpy": sys.modules.get("numpy") is not None},
                  fh)
""")


def _run(tmp_path, mode):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True,
                         text=True, timeout=300, env=dict(env, ZEROSHARD_QUIET="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((tmp_path / f"{mode}.json").read_text())


def _tensors(state):
    return {k: torch.tensor(v) for k, v in state.items()}


def test_nvme_offload_and_safetensors_output_need_no_numpy(tmp_path):
    saved = _tensors(_run(tmp_path, "unblocked")["state"])
    result = _run(tmp_path, "blocked")
    assert result["numpy"] is False
    state = _tensors(result["state"])
    assert all(torch.equal(state[k], saved[k]) for k in saved)  # same seed, same training
    with safe_open(str(tmp_path / "weights" / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == set(state)
        for name, value in state.items():
            saved_value = fh.get_tensor(name)
            assert saved_value.dtype == torch.bfloat16
            assert torch.equal(saved_value.float(), value), name
    [consolidated] = result["files"]
    with safe_open(consolidated, "pt") as fh:
        assert set(fh.keys()) == set(state)
        for name, value in state.items():
            # the checkpoint holds the fp32 masters; rounded to bf16 they are the live weights
            assert torch.equal(fh.get_tensor(name).to(torch.bfloat16).float(), value), name
    assert not os.path.exists(tmp_path / "swap" / "zeroshard")  # swap files removed


def test_write_safetensors_round_trip_with_tied_names_and_dtypes(tmp_path):
    weight = torch.randn(3, 5)
    tensors = {"emb.weight": weight, "head.weight": weight, "scale": torch.tensor(2.5),
               "ids": torch.arange(7), "half": torch.randn(4).to(torch.bfloat16),
               "empty": torch.zeros(0, 3)}
    path = str(tmp_path / "m.safetensors")
    write_safetensors(path, [(k, list(v.shape), v.dtype) for k, v in tensors.items()],
                      tensors.values())
    with safe_open(path, "pt") as fh:
        assert set(fh.keys()) == set(tensors)
        for name, value in tensors.items():
            got = fh.get_tensor(name)
            assert got.dtype == value.dtype and torch.equal(got, value), name


def test_write_safetensors_leaves_nothing_when_a_tensor_fails(tmp_path):
    def tensors():
        yield torch.ones(4)
        raise OSError("disk went away")

    path = tmp_path / "m.safetensors"
    with pytest.raises(OSError, match="disk went away"):
        write_safetensors(str(path), [("a", [4], torch.float32), ("b", [4], torch.float32)],
                          tensors())
    assert os.listdir(tmp_path) == []


def test_write_safetensors_refuses_a_tensor_of_the_wrong_size(tmp_path):
    with pytest.raises(ValueError, match="header says"):
        write_safetensors(str(tmp_path / "m.safetensors"), [("a", [4], torch.float32)],
                          [torch.ones(5)])
    assert os.listdir(tmp_path) == []
