"""DeepSpeed's `deepspeed.git_version_info`: the build facts that environment reports and DeepSpeed's
own test helpers read (`torch_info`, `installed_ops`, `accelerator_name`, `version`).

zeroshard compiles nothing, so no op counts as pre-built (`installed_ops` all False, as in a
DeepSpeed installed without pre-building its ops; `deepspeed.ops.__compatible_ops__` says which
ones zeroshard answers at run time), and `torch_info` holds DeepSpeed's "0.0" values, which its
readers take as "ask torch at run time"."""

from __future__ import annotations

from .accelerator import get_accelerator
from .alias import DEEPSPEED_VERSION
from .ops.op_builder import ANSWERED

#: The DeepSpeed release zeroshard answers for, marked as zeroshard's.
version = DEEPSPEED_VERSION
git_hash = "[none]"
git_branch = "[none]"
#: Ops compiled when the package was built: none here.
installed_ops = dict.fromkeys(ANSWERED, False)
#: The accelerator in use ("cuda" or "cpu", DeepSpeed's DS_ACCELERATOR rules).
accelerator_name = get_accelerator().device_name()
#: What torch the package was built against: DeepSpeed's "unknown, look at run time" values.
torch_info = {"version": "0.0", "bf16_support": False, "cuda_version": "0.0",
              "nccl_version": "0.0", "hip_version": "0.0"}

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "accelerator_name", "torch_info"]
