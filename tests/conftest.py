"""The whole suite runs in strict host mode (`core/hostmem.py`): a tensor in host memory reaching
the default (NCCL-bound) process group, or meeting a compute-device tensor in the library's
host-side code, is an error, as it is on a GPU machine. Ranks spawned by `tests/harness.py` and
subprocesses inherit the setting; `ZEROSHARD_STRICT_HOST=0 pytest` turns it off."""

import os

os.environ.setdefault("ZEROSHARD_STRICT_HOST", "1")
