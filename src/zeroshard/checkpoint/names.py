"""What saving (`save.py`) and loading (`sharded.py`) share: the format version, the names of a
checkpoint's small files, and two helpers."""

from __future__ import annotations

import contextlib
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
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single.*")
        yield


def sampler_of(engine):
    """The DistributedSampler of the DataLoader initialize() built, if any."""
    loader = getattr(engine, "training_dataloader", None)
    sampler = getattr(loader, "sampler", None)
    return sampler if hasattr(sampler, "set_epoch") else None
