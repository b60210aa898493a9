"""`GatheredParameters` and `Init`: DeepSpeed's ZeRO-3 contexts, as they behave at stages 0-2.

At stages 0-2 every rank already holds whole parameters, so `GatheredParameters` gathers nothing.
What it still owes the user is consistency: with `modifier_rank` set, that rank's in-place changes
are broadcast to every rank on exit, and the fp32 master shards (separate copies in bf16/fp16)
are refreshed from the changed parameters, so the next optimizer step does not overwrite the
change. Without `modifier_rank`, changes stay local to each rank, as in DeepSpeed.

`Init` constructs the model normally at stages 0-2 (there is nothing to partition); under a stage-3
config it refuses with "not supported yet" until stage 3 lands.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .comm import Comm
from .config import NotSupportedYetError, load_config
from .optim import OWNER_ATTR


def _as_list(params) -> list[nn.Parameter]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, Iterable):
        return list(params)
    raise TypeError(f"GatheredParameters expects a parameter, a list or a generator of them, "
                    f"got {type(params).__name__}")


class GatheredParameters:
    """Context in which `params` are whole on every rank; `modifier_rank`'s changes are kept."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled or self.modifier_rank is None or exc_type is not None:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not 0 <= self.modifier_rank < world:
            raise ValueError(f"GatheredParameters: modifier_rank {self.modifier_rank} is not a rank "
                             f"of this world of {world}")
        with torch.no_grad():
            for param in self.params if world > 1 else ():
                owner = getattr(param, OWNER_ATTR, None)
                # Through the engine's Comm when there is one, so its comm ledger counts it.
                comm = owner[0].comm if owner is not None else Comm()
                comm.broadcast(param.data, src=self.modifier_rank)
            _refresh_masters(self.params)


def _refresh_masters(params: list[nn.Parameter]) -> None:
    """Copy changed parameters into the fp32 master shards of the units that hold them."""
    for param in params:
        owner = getattr(param, OWNER_ATTR, None)
        if owner is not None:
            optimizer, unit = owner
            optimizer.refresh_master(unit, param)


class Init:
    """Construct a model under a ZeRO config: plain construction at stages 0-2."""

    def __init__(self, config=None, config_dict_or_path=None, enabled: bool = True,
                 remote_device=None, **_ignored):
        source = config if config is not None else config_dict_or_path
        self.enabled = enabled
        if enabled and source is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            cfg = load_config(source, world_size=world)
            if cfg.zero_optimization.stage == 3:
                raise NotSupportedYetError(
                    "not supported yet: zeroshard.Init partitioning at construction (ZeRO stage 3)")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None
