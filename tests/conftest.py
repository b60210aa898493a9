"""The whole suite runs in strict host mode (`dist/hostmem.py`): a tensor in host memory reaching
the default (NCCL-bound) process group, or meeting a compute-device tensor in the library's
host-side code, is an error, as it is on a GPU machine. Ranks spawned by `tests/harness.py` and
subprocesses inherit the setting; `ZEROSHARD_STRICT_HOST=0 pytest` turns it off."""

import os

os.environ.setdefault("ZEROSHARD_STRICT_HOST", "1")

import pytest  # noqa: E402

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module():
    """A module that starts a process group in pytest's own process (a world of one, as a plain
    `python train.py` gets) has it destroyed and its rendezvous variables restored when it ends:
    left alive, its listening port and RANK/MASTER_* would leak into later tests' jobs."""
    before = {key: os.environ.get(key) for key in _RENDEZVOUS}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
