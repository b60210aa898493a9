"""A read-only view of a stage-3 policy, for what is installed on top of it (core/extensions.py).

Installers outside core (compat/: DeepSpeed's parameter attributes, the save guards, Hugging Face's
`generate`) read what they need here: the model, its units, which are sharded and which are
gathered now, and whether the sharded ones fit in `stage3_max_live_parameters` together. The one
action they may take is `hold_all()`: every unit gathered for a block (a `generate` call). The
policy's own state (pending gathers, pins, the schedule) stays out of reach, so it can change
shape without them noticing.
"""

from __future__ import annotations

import contextlib

from torch import nn

from .layout import Unit


class Stage3View:
    """What an installer reads of a stage-3 policy, and `hold_all()`."""

    def __init__(self, policy):
        """`policy`: a stage-3 policy (its `module`, `by_index`, `sharded`, `comm`, `options`
        and `hold_all`)."""
        self._policy = policy

    @property
    def module(self) -> nn.Module | None:
        """The model the policy hooks (None when it was built without one)."""
        return self._policy.module

    @property
    def world_size(self) -> int:
        """Ranks sharing each sharded unit."""
        return self._policy.comm.world_size

    def units(self) -> list[Unit]:
        """Every unit, trained and frozen, by index."""
        by_index = self._policy.by_index
        return [by_index[i] for i in sorted(by_index)]

    def sharded_units(self) -> list[Unit]:
        """The units kept as 1/N shards between uses (not the persistent small ones)."""
        by_index = self._policy.by_index
        return [by_index[i] for i in sorted(self._policy.sharded)]

    def is_sharded(self, unit: Unit) -> bool:
        """Whether `unit` is kept sharded between uses."""
        return unit.index in self._policy.sharded

    @staticmethod
    def is_gathered(unit: Unit) -> bool:
        """Whether `unit` is whole on this rank now (persistent units always are)."""
        return unit.is_gathered

    def fits_whole(self) -> bool:
        """Whether the sharded units together fit in `stage3_max_live_parameters` elements."""
        by_index = self._policy.by_index
        numel = sum(by_index[i].padded_numel for i in self._policy.sharded)
        return numel <= self._policy.options.max_live_parameters

    def hold_all(self) -> contextlib.AbstractContextManager:
        """Context with every sharded unit gathered (exact) and the forward hooks idle; released
        when it ends."""
        return self._policy.hold_all()
