"""The run's own state as a checkpoint stores it: RNG states, the LR scheduler as JSON, the
user's `client_state`, and the conversions they need (what is saved of the run, and when it is
put back, is the engine's `TrainState`, `train_state.py`)."""

from __future__ import annotations

import io
import os
import random
import warnings

import torch

from ..core.state import jsonable
from .names import rng_file
from .verify import CheckpointError, torch_load_verified


def check_client_state(client_state) -> bytes:
    """`client_state` serialized; ValueError unless torch.load(weights_only=True) reads it back."""
    buffer = io.BytesIO()
    try:  # one rank's unpicklable client_state (a lambda) must not leave its peers waiting
        torch.save(client_state, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as err:
        raise ValueError(
            "client_state can only hold tensors, numbers, strings, lists, tuples and dicts "
            "(it is read back with torch.load(weights_only=True), so a checkpoint cannot run "
            f"code); this one cannot be stored: {str(err).splitlines()[0]}") from None
    return buffer.getvalue()


def scheduler_state(scheduler):
    """The LR scheduler's state as JSON, or None (none, or not serializable: warned)."""
    if scheduler is None or not hasattr(scheduler, "state_dict"):
        return None
    try:
        return jsonable(scheduler.state_dict())
    except TypeError as err:
        warnings.warn(f"zeroshard: LR scheduler state holds a {err} and is not saved; the "
                      "scheduler restarts from its initial state on load", stacklevel=8)
        return None


def rng_state() -> dict:
    """This process's torch, Python and CUDA RNG states."""
    state = {"torch": torch.get_rng_state(), "python": jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(rng: dict) -> None:
    """Put this process's RNGs back to a state `rng_state()` returned (or read_rng read)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(as_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def read_rng(path: str, rank: int, files: dict | None) -> dict | None:
    """This rank's saved RNG state, tried on scratch generators; None if it saved none (the
    checkpoint came from fewer ranks: this rank keeps its own)."""
    name = rng_file(rank)
    saved = name in files if files is not None else os.path.isfile(os.path.join(path, name))
    if not saved:
        return None
    rng = torch_load_verified(path, name, files)
    try:
        torch.Generator().set_state(rng["torch"])
        random.Random().setstate(as_tuple(rng["python"]))
    except Exception as err:  # noqa: BLE001 - any malformed content
        raise CheckpointError(f"checkpoint file {os.path.join(path, name)} holds no usable RNG "
                              f"state ({type(err).__name__}: {err})") from None
    return rng


def as_tuple(value):
    """`value` with every list turned into a tuple, recursively (JSON gives back lists)."""
    if isinstance(value, list):
        return tuple(as_tuple(v) for v in value)
    return value
