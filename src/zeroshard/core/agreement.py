"""The ranks agree on what they built before the first collective that depends on it.

ZeRO lays every rank's parameters out the same way and trusts that every rank built the same
model. Ranks that did not (a shape from a rank-dependent argument, another code version on one
host) either abort inside gloo at the first collective whose sizes differ, with no Python
traceback, or, with the same total size, train two different models under one job. So at
`initialize()` each rank hashes a description of its model (every parameter's name, full shape,
dtype and `requires_grad`; every buffer's name, shape and dtype) and of the config's effective
training values, and the digests (64 characters each, so the collective's sizes always match)
are compared in one all-gather. Only when they differ do the ranks exchange the descriptions
themselves, to name the first difference and which rank has what; every rank then raises
`RankMismatchError` with the same text.

Config values that may differ per rank without harm (paths, logging and monitoring) are left out.
"""

from __future__ import annotations

import hashlib
import json

from torch import nn

from .layout import full_shape

#: Config sections that only log or monitor: they may differ per rank.
_NOT_COMPARED = ("tensorboard", "csv_monitor", "wandb", "comet", "flops_profiler", "comms_logger",
                 "steps_per_print", "wall_clock_breakdown")


class RankMismatchError(RuntimeError):
    """The ranks built different models, or were given different configs."""


def describe_model(model: nn.Module) -> list[list]:
    """[kind, name, shape, dtype, requires_grad] for every parameter, then every buffer."""
    out = [["parameter", name, list(full_shape(p)), str(p.dtype).replace("torch.", ""),
            bool(p.requires_grad)] for name, p in model.named_parameters()]
    out += [["buffer", name, list(b.shape), str(b.dtype).replace("torch.", ""), None]
            for name, b in model.named_buffers()]
    return out


def describe_config(config) -> dict:
    """The config's training values as flat dotted keys (paths and logging left out)."""
    raw = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config or {})
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif not prefix.rsplit(".", 1)[-1].endswith("path"):
            flat[prefix] = value

    walk("", {k: v for k, v in raw.items() if k not in _NOT_COMPARED})
    return flat


def check_ranks_agree(comm, model: nn.Module, config=None) -> None:
    """Raise RankMismatchError on every rank unless every rank built the same model and config."""
    if comm.world_size == 1:
        return
    mine = (describe_model(model), describe_config(config) if config is not None else {})
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).hexdigest()
    digests = comm.all_gather_object(digest)
    if len(set(digests)) == 1:
        return
    views = comm.all_gather_object(mine)  # only on a mismatch: name the first difference
    raise RankMismatchError(_first_difference([v[0] for v in views], [v[1] for v in views]))


def _by_value(values: list, show) -> str:
    """"ranks 0, 2: X; rank 1: Y" for per-rank values."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(show(value), []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                     for text, r in groups.items())


def _entry(entry) -> str:
    if entry is None:
        return "nothing (it has fewer parameters and buffers)"
    kind, name, shape, dtype, grad = entry
    text = f"{kind} {name} shape {tuple(shape)} {dtype}"
    return text + ("" if grad is None else f" requires_grad={grad}")


def _first_difference(models: list[list], configs: list[dict]) -> str:
    advice = ("Every rank must build the same model (the same code and arguments; nothing that "
              "depends on the rank) and pass the same config; nothing was trained")
    longest = max(len(m) for m in models)
    for i in range(longest):
        entries = [m[i] if i < len(m) else None for m in models]
        if any(e != entries[0] for e in entries):
            counts = _by_value(models, lambda m: f"{len(m)} parameters and buffers")
            return (f"initialize(): the ranks built different models. First difference, at "
                    f"entry {i} of the model's parameters and buffers: "
                    f"{_by_value(entries, _entry)} (in all: {counts}). {advice}")
    keys = sorted({k for c in configs for k in c})
    for key in keys:
        values = [c.get(key, "<absent>") for c in configs]
        if any(v != values[0] for v in values):
            return (f"initialize(): the ranks were given different configs. First difference: "
                    f"{key} = {_by_value(values, repr)}. {advice}")
    return f"initialize(): the ranks' descriptions of their model differ. {advice}"
