"""The world a run's collectives go through, made in one place: `World`.

A `World` holds the Comm over the default process group, the subgroups a feature asks for (MiCS's
shard and replica groups, made once each: `split`), the one comm ledger all of them count into,
the process's step counter and the desync watchdog's deadline. Every Comm it makes gets those at
construction (`groups.py` makes a subgroup's from its parent's); nothing is attached afterwards.

The builder (`build.py`) makes one per engine, from the config's `zeroshard_desync_timeout`, so
an engine's `comm_report()` counts its own collectives from its build on; that World becomes the
current one. Code that needs the world outside a build (`zeroshard.Init`, `GatheredParameters`
on parameters no engine manages, Accelerate's `Accelerator`) asks `World.current()`: the current
World, or, when there is none yet, a plain one made then (no watchdog), which becomes current.
Destroying the default group forgets the current World (its Comms belong to the group).
"""

from __future__ import annotations

import torch.distributed as dist

from .comm import Comm
from .groups import split
from .ledger import Ledger
from .process_group import on_default_group_destroyed
from .steps import PROCESS_STEPS, StepCounter
from .watchdog import Watchdog

_CURRENT: "World | None" = None


class World:
    """The default group's Comm, its subgroups, one ledger, the step counter, the deadline."""

    def __init__(self, desync_timeout_s: float = 0.0, steps: StepCounter = PROCESS_STEPS):
        self.ledger = Ledger()
        self.steps = steps
        #: Seconds a collective may wait before the watchdog diagnoses it (0: no watchdog).
        self.desync_timeout_s = float(desync_timeout_s)
        self.comm = Comm(ledger=self.ledger, steps=steps,
                         watch=Watchdog.arm(None, self.desync_timeout_s, steps))
        self._parts: dict[tuple, Comm] = {}

    @property
    def rank(self) -> int:
        """This process's rank in the world."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.comm.world_size

    def split(self, parts: list[list[int]]) -> Comm:
        """This rank's Comm over its part of `parts` (world ranks), made on first request: its
        bytes go into this World's ledger, its waits get this World's deadline."""
        key = tuple(tuple(part) for part in parts)
        if key not in self._parts:
            self._parts[key] = split(self.comm, parts)
        return self._parts[key]

    @classmethod
    def build(cls, desync_timeout_s: float) -> "World":
        """A new World (the builder's, for one engine), made the current one."""
        global _CURRENT
        _CURRENT = cls(desync_timeout_s)
        return _CURRENT

    @classmethod
    def current(cls) -> "World":
        """The current World; a plain one (no watchdog) if there is none. The default group must
        exist (`init_distributed()`)."""
        global _CURRENT
        if _CURRENT is None or not dist.is_initialized():
            if not dist.is_initialized():
                raise RuntimeError("zeroshard: no process group: call zeroshard.init_distributed() "
                                   "(or torch.distributed.init_process_group) first")
            _CURRENT = cls()
        return _CURRENT


def _forget() -> None:
    """The default group is gone: so is the current World."""
    global _CURRENT
    _CURRENT = None


on_default_group_destroyed(_forget)
