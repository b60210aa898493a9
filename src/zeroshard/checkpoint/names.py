"""What saving (`save.py`) and loading (`sharded.py`) share: the format version, the names of a
checkpoint's small files, and three helpers."""

from __future__ import annotations

import contextlib
import os
import warnings

FORMAT = 1  # "files" and "content_sha256" were added without a bump: older readers ignore them
META = "zeroshard.json"
CLIENT = "client_state.pt"
CONFIG = "config.json"
LATEST = "latest"


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns when it loads without a process group (consolidate, one-process runs), which
    does not concern the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore",
                                message=".*assuming the intent is to (load|save) in a single.*")
        yield


def sampler_of(engine):
    """The DistributedSampler of the DataLoader initialize() built, if any."""
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    return sampler if hasattr(sampler, "set_epoch") else None


def unknown_format(path: str) -> str:
    """Why `path` is read as no checkpoint: what it holds instead."""
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"{path} is neither a zeroshard checkpoint (no {META}) nor a DeepSpeed one (no "
            "mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt); it holds "
            f"{shown or 'nothing'}")
