"""Where the stage-3 policy keeps its parameter shards between gathers: the interface it calls,
and the default that keeps them on the compute device. CPU memory and NVMe implementations are
placements (`offload/param.py`), made by build.py and given to the stage-3 policy."""

from __future__ import annotations

import torch

from .layout import Unit


class ShardStore:
    """Shards stay where stage 3 put them (on the device)."""

    name = "device"

    def __init__(self, units: list[Unit] = ()):
        self.units = {u.index: u for u in units}

    def source(self, unit: Unit) -> torch.Tensor:
        """The unit's shard on the compute device, valid until `done(unit)`."""
        return unit.shard

    def done(self, unit: Unit) -> None:
        """The gather from `source(unit)` has completed."""

    def read_ahead(self, indices) -> None:
        """Start fetching the shards of upcoming units (offloaded stores only)."""

    def read(self, unit: Unit) -> torch.Tensor:
        """The shard's current values (compute dtype)."""
        return unit.shard

    def write(self, unit: Unit, values: torch.Tensor) -> None:
        """Set the shard from `values` (any dtype, cast)."""
        if unit.shard.data_ptr() != values.data_ptr():
            unit.shard.copy_(values, non_blocking=values.is_pinned())

    def flush(self) -> None:
        """Wait for writes in flight; raise NvmeError if one failed."""

    def drain(self) -> None:
        """Wait for writes in flight, dropping failures (after an error was reported)."""

    def tensors(self) -> list[torch.Tensor]:
        """Shards held in memory (for the ledger, under `name`)."""
        return [u.shard for u in self.units.values()]

    def buffers(self) -> list[torch.Tensor]:
        """Staging memory (for the ledger, "buffers" on the CPU)."""
        return []

    def device_buffers(self) -> list[torch.Tensor]:
        """Copies of shards on the compute device: read ahead, or feeding a gather (for the
        ledger, "buffers" on the device)."""
        return []

    def nvme_bytes(self) -> int:
        """Bytes of swap files."""
        return 0

    def close(self) -> None:
        """Release files and threads."""
