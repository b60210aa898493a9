"""What saving (`save.py`) and loading (`sharded.py`, `portable_load.py`) share: the format
version, the names of a checkpoint's small files, what the engine hands over (`Parts`), and two
helpers."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, NamedTuple

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


def rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file."""
    return f"rng-rank{rank}.pt"


class Parts(NamedTuple):
    """What the engine hands a save or a load (never the engine itself)."""

    #: The wrapped model: parameters outside the units, buffers, names, a transformers config.
    module: Any
    #: The data-parallel world (zeroshard.dist.Comm).
    comm: Any
    #: The ZeRO stage, recorded in zeroshard.json.
    stage: int
    #: Counters, loss scaler, LR scheduler, sampler, RNG (zeroshard.train_state.TrainState).
    train: Any
    #: This rank's masters and optimizer state (core/state.ShardedState), one per engine.
    shards: Any


def unknown_format(path: str) -> str:
    """Why `path` is read as no checkpoint: what it holds instead."""
    names = sorted(os.listdir(path))
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"{path} is neither a zeroshard checkpoint (no {META}) nor a DeepSpeed one (no "
            "mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt); it holds "
            f"{shown or 'nothing'}")
