"""DeepSpeed's `deepspeed.utils.torch.required_torch_version`, which scripts (and DeepSpeed's own
tests) call to branch on the installed torch: whether torch's version lies within the bounds."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the installed torch is at least `min_version` and at most `max_version` (numbers or
    strings such as 2.1 or "2.4.0"); at least one bound is required."""
    if not min_version and not max_version:
        raise ValueError("required_torch_version: pass min_version, max_version or both "
                         "(e.g. min_version=2.1)")
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    if max_version and installed > str(max_version):
        return False
    return True


__all__ = ["required_torch_version"]
